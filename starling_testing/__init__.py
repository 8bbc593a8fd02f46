"""starling_testing: what Starling's tests and benchmarks are built from, for the project and its users (as
``trio.testing`` is for trio). It sits above ``node`` in the import layers (pyproject.toml's
``[tool.importlinter]``): it may import the product, the product never imports it, and tests and benchmarks
import it instead of each other.

Files and their main names:

* ``netlab.py``: a network lab of Linux network namespaces with real NATs (:class:`Lab`, :class:`Host`,
  :class:`Proc`; ``python -m starling_testing.netlab --sweep`` removes namespaces left by a crash);
  its links take a rate (tc tbf), and latency, jitter and loss from ``delayline.py``, a userspace delay line
  on NFQUEUE (this kernel has no netem);
* ``daemon.py``: real `starling run` daemons on 127.0.0.1 or in a lab (:class:`DaemonProc`,
  :class:`DaemonGroup`, :class:`LabDaemon`, :data:`TINY`), all started by the one launcher
  (``node.ops.launcher.DaemonProcess``) and read through the one status client (``node.ops.control.request_status``);
* ``fakes.py``: transport test doubles (``ScriptedStream``, ``FakeNetStream``, ``FakeHost``, ``RefusingProber``);
* ``conformance.py``: the :class:`p2p.wire.FrameChannel` contract as checks (``FRAME_CHANNEL_CHECKS``,
  ``check_frame_channel``);
* ``averaging.py``: ``FakeSwarm``, the swarm an averager sees outside a daemon; ``exchange_both``, two real
  averagers' exchanges at once, and ``group_sizes``;
* ``fuzz.py``: the fuzzer's targets, mutator and runner (``make fuzz``; tests/test_fuzz.py drives the same
  targets with hypothesis);
* ``adversary.py``: hostile averaging partners against a real victim (``make bench-adversary``);
* ``report.py``: ``replace_section``, how benchmarks write their figures into docs/;
* ``disk.py``: ``tiny_tmpfs``, a small tmpfs for tests of a full disk;
* ``exchange_lab.py``: one averaging exchange at a time between two lab hosts, its phases timed (what
  latency costs an exchange: ``bench/exchange_rtt.py``, tests/test_exchange_rtt.py);
* ``swim_sim.py``: :class:`SimNet`, an in-process network (latency, loss, cuts) of SWIM membership cores.

Only the network lab and the daemon helpers are imported here (they need neither torch nor libp2p); import
the other modules by name.
"""

from starling_testing.daemon import TINY, TINY_TRAIN, DaemonError, DaemonGroup, DaemonProc, LabDaemon
from starling_testing.netlab import Host, Lab, LabError, Proc

__all__ = [
    "TINY", "TINY_TRAIN", "DaemonError", "DaemonGroup", "DaemonProc", "Host", "Lab", "LabDaemon", "LabError",
    "Proc",
]  # fmt: skip
