"""EngineLoadTable: the coordinator's latest (waiting, running) per engine core.

Engines report on change (throttled) and at least every heartbeat interval, so a row that
stops refreshing belongs to an engine that is gone or frozen; it drops out of the table and so
out of the api's routing (the api also drops an engine it sees die on its own sockets).
"""

from __future__ import annotations

from kvserve.shared.wire import EngineLoad


class EngineLoadTable:
    """
    Args:
        stale_after_s: seconds without a report after which an engine's row is dropped.
    """

    def __init__(self, stale_after_s: float):
        assert stale_after_s > 0, stale_after_s
        self.stale_after_s = stale_after_s
        self._rows: dict[int, EngineLoad] = {}
        self._last_report_time: dict[int, float] = {}
        # Set by every change to what `snapshot` returns; the publisher clears it.
        self.changed = False

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, engine_index: int) -> bool:
        return engine_index in self._rows

    def update(self, load: EngineLoad, now: float) -> None:
        """Record an engine's report (a new engine joins the table here)."""
        if self._rows.get(load.engine_index) != load:
            self.changed = True
        self._rows[load.engine_index] = load
        self._last_report_time[load.engine_index] = now

    def drop_stale(self, now: float) -> list[int]:
        """Forget engines silent for longer than stale_after_s; returns their indices."""
        stale_ids = [
            engine_index
            for engine_index, seen in self._last_report_time.items()
            if now - seen > self.stale_after_s
        ]
        for engine_index in stale_ids:
            del self._rows[engine_index]
            del self._last_report_time[engine_index]
        self.changed |= bool(stale_ids)
        return stale_ids

    def snapshot(self) -> list[EngineLoad]:
        """Every live engine's latest load, by engine index."""
        return [self._rows[engine_index] for engine_index in sorted(self._rows)]
