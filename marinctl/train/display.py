"""What a person watching the run sees (stderr): the header, a live line, warnings, the final table.

On a terminal a rich progress bar shows step, loss, tokens/s, MFU, drop rate and ETA; in a log file
(a scheduler's stdout/stderr) the same figures print as plain lines about twenty times per run; quiet
mode prints nothing but errors.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class LiveDisplay:
    def __init__(self, console: Console, total_steps: int, start_step: int, *, enabled: bool):
        self.console, self.total, self.enabled = console, total_steps, enabled
        self.interactive = enabled and console.is_terminal
        self.every = max(1, (total_steps - start_step) // 20)
        self._start_time, self._start_step = time.perf_counter(), start_step
        self.note = ""  # e.g. the last eval's distance from the ladder forecast, shown after the figures
        self._progress: Progress | None = None
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[figures]}"),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, figures="")
            self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        figures = (
            f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  MFU {record['mfu']:.1%}  "
            f"drop {record['drop_frac']:.2%}{self.note}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, figures=figures)
        elif (step + 1) % self.every == 0 or step + 1 == self.total:
            done = step + 1 - self._start_step
            elapsed = time.perf_counter() - self._start_time
            eta = elapsed / max(done, 1) * (self.total - step - 1)
            self.console.print(f"step {step + 1}/{self.total}  {figures}  ETA {eta:,.0f}s")

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def header_table(rows: list[tuple[str, str]], title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def eval_table(first: dict[str, Any] | None, last: dict[str, Any], sources: tuple[str, ...]) -> Table:
    """Per-domain dropless eval losses and the macro loss, beside the run's first evaluation."""
    table = Table(title=f"eval at step {last['step']} (dropless)", header_style="bold", title_justify="left")
    table.add_column("source")
    table.add_column("loss (nats/token)", justify="right")
    table.add_column("bits/byte", justify="right")
    if first is not None:
        table.add_column(f"loss at step {first['step']}", justify="right")
        table.add_column("change", justify="right")
    for source in sources:
        row = [source, f"{last[f'loss/{source}']:.4f}", f"{last[f'bpb/{source}']:.4f}"]
        if first is not None:
            before = first[f"loss/{source}"]
            row += [f"{before:.4f}", f"{last[f'loss/{source}'] - before:+.4f}"]
        table.add_row(*row)
    row = ["[bold]macro", f"[bold]{last['macro_loss']:.4f}", ""]
    if first is not None:
        row += [f"{first['macro_loss']:.4f}", f"[bold]{last['macro_loss'] - first['macro_loss']:+.4f}"]
    table.add_row(*row)
    return table
