"""Error types shared by the torch-free layers (core, lab, bench).

`WorkloadError` is the one error for a workload description that cannot be drawn, read or
built: the lab's (output/prompt lengths, ranges, a lengths file) and the benchmark client's
(workload names, rates, length families). It is a client error (bad input, a 4xx or a CLI
usage line), never a server fault, so it derives from ValueError; the message names the
option, file or line at fault.
"""

from __future__ import annotations


class WorkloadError(ValueError):
    """A workload that cannot be drawn, read or built; the message says what and where."""
