"""Host-side bookkeeping of the two device caches: KV pages and GDN state slots.

The device arrays are owned by the runner; these pools only decide which page or slot id belongs to
which request. Each pool keeps one id back as a trash target: the runner pads every batch to a compiled
bucket, and padding rows must write somewhere harmless without a per-row branch in the kernels.

No jax import here: the scheduler runs and is tested on the host alone.
"""

from __future__ import annotations

TRASH_PAGE = 0


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` KV entries (ceil division)."""
    return -(-num_tokens // page_size)


class PagePool:
    """KV-cache pages `1 .. num_pages-1`; page 0 is the trash page and is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        assert num_pages >= 2, "a page pool needs the trash page and at least one allocatable page"
        assert page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        # Popped from the end, so low page ids go out first: easier to read in traces.
        self._free_list = list(range(num_pages - 1, TRASH_PAGE, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_total(self) -> int:
        """Allocatable pages (the trash page is not counted)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free_list)

    def allocate(self, num: int) -> list[int]:
        assert 0 <= num <= len(self._free_list), f"asked for {num} pages, {len(self._free_list)} free"
        pages = self._free_list[len(self._free_list) - num :][::-1]
        del self._free_list[len(self._free_list) - num :]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int] | tuple[int, ...]) -> None:
        for page in pages:
            assert TRASH_PAGE < page < self.num_pages, f"page {page} is not an allocatable page"
            assert not self._is_free[page], f"page {page} freed twice"
            self._is_free[page] = True
        # Reversed so that a request's pages come back out in the same order on the next allocate.
        self._free_list.extend(reversed(pages))


class SlotPool:
    """GDN state slots `0 .. num_slots-2`; slot `num_slots-1` is the trash slot for padding rows."""

    def __init__(self, num_slots: int):
        assert num_slots >= 2, "a slot pool needs the trash slot and at least one allocatable slot"
        self.num_slots = num_slots
        self._free_list = list(range(num_slots - 2, -1, -1))
        self._is_free = [True] * (num_slots - 1) + [False]

    @property
    def trash_slot(self) -> int:
        return self.num_slots - 1

    @property
    def num_total(self) -> int:
        """Allocatable slots (the trash slot is not counted)."""
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free_list)

    def can_allocate(self) -> bool:
        return bool(self._free_list)

    def allocate(self) -> int:
        assert self._free_list, "no free GDN slot"
        slot = self._free_list.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.trash_slot, f"slot {slot} is not an allocatable slot"
        assert not self._is_free[slot], f"slot {slot} freed twice"
        self._is_free[slot] = True
        self._free_list.append(slot)
