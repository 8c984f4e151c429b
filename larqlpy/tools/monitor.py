"""Resource curves: sample the process's memory at a fixed interval, beside the current position.

RSS comes from psutil (this process plus its children, so `batch --workers` counts its workers),
CUDA memory from torch.cuda when the run has loaded torch and uses a GPU (the monitor itself does not
load torch). Written atomically, as CSV or JSON by the file's suffix.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import threading
import time
from pathlib import Path

import psutil

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write, check_output

FIELDS = ("t_s", "position", "rss_bytes", "cuda_allocated_bytes")


def check_paths(data: Path | None, plot: Path | None) -> None:
    """Refuse bad output paths before any work starts."""
    if data is not None and data.suffix.lower() not in (".csv", ".json"):
        raise LarqlError(f"`monitor`: expected a .csv or .json path, got {data}")
    if plot is not None and data is None:
        raise LarqlError("`monitor_plot` needs `monitor`")
    if plot is not None and plot.suffix.lower() != ".png":
        raise LarqlError(f"`monitor_plot`: expected a .png path, got {plot}")
    if data is not None:
        check_output(data, "`monitor`")
    if plot is not None:
        check_output(plot, "`monitor_plot`")


class Monitor:
    def __init__(self, path: Path, interval: float = 0.05, plot: Path | None = None):
        check_paths(path, plot)
        self.path, self.interval, self.plot_path = Path(path), interval, plot
        self.position = 0  # the caller keeps it current
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def sample(self) -> None:
        rss = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass
        self.samples.append({"t_s": round(time.perf_counter() - self._t0, 4), "position": self.position,
                             "rss_bytes": rss, "cuda_allocated_bytes": _cuda_allocated()})

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "Monitor":
        self._t0 = time.perf_counter()
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.write()

    def write(self) -> None:
        with atomic_write(self.path, "`monitor`") as f:
            if self.path.suffix.lower() == ".json":
                f.write((json.dumps({"interval_s": self.interval, "samples": self.samples}) + "\n").encode())
            else:
                text = io.StringIO(newline="")
                w = csv.DictWriter(text, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(self.samples)
                f.write(text.getvalue().encode())
        if self.plot_path is not None:
            self.plot(self.plot_path)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [s["t_s"] for s in self.samples]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
        ax.plot(t, [s["rss_bytes"] / 2**20 for s in self.samples], color="tab:blue", label="RSS")
        if any(s["cuda_allocated_bytes"] for s in self.samples):
            ax.plot(t, [s["cuda_allocated_bytes"] / 2**20 for s in self.samples], color="tab:green", label="CUDA")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax2 = ax.twinx()
        ax2.plot(t, [s["position"] for s in self.samples], color="tab:orange", label="position")
        ax2.set_ylabel("position")
        fig.legend(loc="upper left", fontsize=8)
        ax.set_title("memory over time")
        fig.tight_layout()
        with atomic_write(path, "`monitor_plot`") as f:
            fig.savefig(f, format="png")
        plt.close(fig)


def _cuda_allocated() -> int:
    torch = sys.modules.get("torch")  # only a run that loaded torch can have CUDA memory to count
    return torch.cuda.memory_allocated() if torch is not None and torch.cuda.is_initialized() else 0
