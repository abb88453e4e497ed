"""Scheduler, engine loop, OpenAI HTTP server and benchmark client."""
