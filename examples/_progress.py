"""What the training examples print: a progress bar on a terminal, a line per epoch.

Not an example itself; the examples import it (Python puts their folder on the path).
"""

import sys
import time


PROGRESS_CHOICES = ("auto", "always", "never")
PROGRESS_HELP = ("progress bar: auto draws one when stdout is a terminal; under mpiexec "
                 "it is a pipe even then, so use always there to see it")


def show_bar(progress: str) -> bool:
    """Whether ``--progress`` (one of :data:`PROGRESS_CHOICES`) asks for a bar."""
    return progress == "always" or (progress == "auto" and sys.stdout.isatty())


class ProgressBar:
    """One epoch's progress bar on stdout, redrawn in place with a carriage return.

    Draws nothing unless ``enabled``: on rank 0, when :func:`show_bar` says so.
    """

    def __init__(self, label: str, steps: int, enabled: bool, width: int = 30):
        self.label = label
        self.steps = max(steps, 1)
        self.width = width
        self.enabled = enabled
        self._drawn = 0.0

    def update(self, step: int, loss: float) -> None:
        """Show ``step`` of ``steps`` done, at most 20 times a second."""
        now = time.monotonic()
        if not self.enabled or (step < self.steps and now - self._drawn < 0.05):
            return
        self._drawn = now
        filled = self.width * step // self.steps
        bar = "#" * filled + "." * (self.width - filled)
        sys.stdout.write(f"\r{self.label} [{bar}] {step}/{self.steps} loss {loss:.4f}")
        sys.stdout.flush()

    def close(self) -> None:
        """Erase the bar, so the epoch line takes its place."""
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def epoch_line(epoch: int, epochs: int, loss: float, accuracy: float, samples: int,
               seconds: float, train_seconds: float) -> str:
    """``epoch 3/5: loss 0.4123, accuracy 0.871, 52,000 samples/s, 0.41 s``.

    ``samples`` counts those trained on by all ranks; the rate is over ``train_seconds``.
    """
    rate = samples / train_seconds if train_seconds > 0 else float("inf")
    return (f"epoch {epoch}/{epochs}: loss {loss:.4f}, accuracy {accuracy:.3f}, "
            f"{rate:,.0f} samples/s, {seconds:.2f} s")
