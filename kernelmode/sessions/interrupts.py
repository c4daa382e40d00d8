"""Where an interrupt goes: to the kernel at once, or held for a run's cell not started yet."""

from __future__ import annotations


class InterruptLatch:
    """Where an interrupt goes. ipykernel ignores SIGINT between cells, so an interrupt asked
    for before the run's cell has started (kernel being readied, preamble, request in flight) is
    held and delivered when the cell starts."""

    def __init__(self) -> None:
        self.requested = False  # the current run was asked to stop (its KeyboardInterrupt is ours)
        self.held = False
        self.cell_started = True  # no run waiting for its cell: an interrupt goes out at once

    def arm(self) -> None:
        """A run takes the kernel: from here an interrupt is its own, even before its cell starts."""
        self.requested, self.held, self.cell_started = False, False, False

    def disarm(self) -> None:
        """The run is over: interrupts go straight to the kernel again."""
        self.cell_started, self.held = True, False

    def request(self, console_busy: bool) -> bool:
        """Someone asks for an interrupt; True: deliver it now (else it is held for the cell)."""
        self.requested = True
        if not self.cell_started and not console_busy:
            self.held = True
            return False
        return True  # the run's cell, or a person's console cell, is what the kernel runs

    def stop(self) -> bool:
        """The run passed its timeout; True: deliver now (else held until its cell starts)."""
        if self.cell_started:
            return True
        self.held = True
        return False

    def cell_start(self) -> bool:
        """The run's cell started; True: an interrupt was held for it, deliver it now."""
        self.cell_started = True
        held, self.held = self.held, False
        return held
