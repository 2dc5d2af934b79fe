"""Distribution of K-FAC work across ranks: assignment, communicator, ledger and strategies.

Entry points others call:

* :func:`make_strategy` — the strategy object for a config (the preconditioner's factory);
* :class:`Communicator` and :func:`average_gradients` — collectives recorded in a
  :class:`Ledger`;
* :func:`simulate` — the ledger and memory of any world size in one process.
"""

from core.distributed.assignment import Assignment, Placement, assign
from core.distributed.communicator import Communicator, average_gradients
from core.distributed.ledger import Ledger, LedgerEntry
from core.distributed.simulate import SimulationReport, simulate
from core.distributed.strategies import DistributedStrategy, make_strategy

__all__ = [
    "Assignment", "Communicator", "DistributedStrategy", "Ledger", "LedgerEntry", "Placement",
    "SimulationReport", "assign", "average_gradients", "make_strategy", "simulate",
]
