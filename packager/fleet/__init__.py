"""Flash a bundle to a fleet of devices over SSH (fabric): staged, verified, health-checked, atomic, rolled
back on failure.

Per host: connect (known host keys only) -> preflight (profile, architecture, python, TVM or the bundle's runtime, disk) -> upload
the archive and edgeq's stdlib verifier (``safebundle.py``) -> on the device: verify signature and every
file, unpack into ``<root>/releases/<bundle-id>`` (``stage``) -> ``run.py --self-test`` there -> switch
``<root>/current`` atomically (``activate``) -> ``run.py --self-test`` through ``current`` -> prune. A failure
after the switch switches back (``rollback``). Hosts go canaries first, then in batches, ``--parallel`` at a
time; once failures exceed ``--max-failures`` no new host starts.

The fleet file's schema is ``config``, one host over SSH ``device``, the rollout ``rollout``.
"""

from __future__ import annotations

from edgeq.fleet.config import MAX_HOSTS, MAX_PARALLEL, Fleet, Host, load_fleet, parse_count
from edgeq.fleet.device import Device, HostFailure
from edgeq.fleet.rollout import (FlashArgs, FlashPlan, HostResult, check_args, flash, flash_host, fleet_rollback,
                                 fleet_status, waves)

__all__ = ["MAX_HOSTS", "MAX_PARALLEL", "Device", "FlashArgs", "FlashPlan", "Fleet", "Host", "HostFailure",
           "HostResult", "check_args", "flash", "flash_host", "fleet_rollback", "fleet_status", "load_fleet",
           "parse_count", "waves"]
