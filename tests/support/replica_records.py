"""``replica.json`` files as the local driver wrote them before its record was a typed value, byte for byte (one
driver's run on a test host): what a newer driver must still read, adopt and write back in the same format."""

from __future__ import annotations

WRITTEN_BEFORE: dict[str, str] = {
    "a running notebook, run as a process": (
        '{"id": "rp_nb1", "workload_id": "wl_nb1", "kind": "notebook", "cls": "cpu-1c-4g", "node": "box", '
        '"owner": "alice", "model": null, "image": null, "sandbox": false, "uid": null, "state": "running", '
        '"pid": 6515, "proc_start": 1155255, "port": 41017, "address": "127.192.92.205", '
        '"host": "127.192.92.205", "token": "sPfZad-bX2fXaW4LY_BuXxskz2rXEkU2", '
        '"url": "http://127.192.92.205:41017/lab?token=sPfZad-bX2fXaW4LY_BuXxskz2rXEkU2", "socket": null, '
        '"console": null, "served_model": null, "detail": "", "started_at": 1796674937.830109, '
        '"stop_requested_at": null, "ended_at": null, "gpus": [], "cpuset": [], "oom_kills": 0, '
        '"home_mounted": true}'),
    "a notebook stopped": (
        '{"id": "rp_nb1", "workload_id": "wl_nb1", "kind": "notebook", "cls": "cpu-1c-4g", "node": "box", '
        '"owner": "alice", "model": null, "image": null, "sandbox": false, "uid": null, "state": "stopped", '
        '"pid": 6515, "proc_start": 1155255, "port": 41017, "address": "127.192.92.205", '
        '"host": "127.192.92.205", "token": "sPfZad-bX2fXaW4LY_BuXxskz2rXEkU2", '
        '"url": "http://127.192.92.205:41017/lab?token=sPfZad-bX2fXaW4LY_BuXxskz2rXEkU2", "socket": null, '
        '"console": null, "served_model": null, "detail": "stopped", "started_at": 1796674937.830109, '
        '"stop_requested_at": 1796674944.94051, "ended_at": 1796674946.751395, "gpus": [], "cpuset": [], '
        '"oom_kills": 0, "home_mounted": true}'),
    "an endpoint failed for good (no runtime installed)": (
        '{"id": "rp_ep1", "workload_id": "wl_ep1", "kind": "endpoint", "cls": "cpu-1c-4g", "node": "box", '
        '"owner": "alice", "model": "/nonexistent", "image": null, "sandbox": false, "uid": null, '
        '"state": "failed", "pid": null, "proc_start": null, "port": null, "address": null, "host": null, '
        '"token": null, "url": null, "socket": null, "console": null, "served_model": null, '
        '"detail": "no model runtime is installed for cpu endpoints'
        ' in /tmp/drv/gen/data/rt: tensora runtime install tensora-transformers", '
        '"started_at": 1796674938.3366895, "stop_requested_at": null, "ended_at": 1796674938.3367634, '
        '"gpus": [], "cpuset": [], "oom_kills": 0, "permanent": true}'),
    "a VM running in its sandbox": (
        '{"id": "rp_vm1", "workload_id": "wl_vm1", "kind": "vm", "cls": "cpu-1c-4g", "node": "box", '
        '"owner": "alice", "model": null, "image": null, "sandbox": true, "uid": 1001234, '
        '"state": "running", "pid": 7581, "proc_start": 1156948, "port": null, "address": null, '
        '"host": null, "token": null, "url": null, '
        '"socket": "/tmp/drv/gen/data2/replicas/rp_vm1/vm/qmp.sock", '
        '"console": "/tmp/drv/gen/data2/replicas/rp_vm1/vm/console.log", "served_model": null, '
        '"detail": "accel kvm", "started_at": 1796674955.1972446, "stop_requested_at": null, '
        '"ended_at": null, "gpus": [], "cpuset": [1], "oom_kills": 0}'),
    "a VM stopped": (
        '{"id": "rp_vm1", "workload_id": "wl_vm1", "kind": "vm", "cls": "cpu-1c-4g", "node": "box", '
        '"owner": "alice", "model": null, "image": null, "sandbox": true, "uid": 1001234, '
        '"state": "stopped", "pid": 7581, "proc_start": 1156948, "port": null, "address": null, '
        '"host": null, "token": null, "url": null, '
        '"socket": "/tmp/drv/gen/data2/replicas/rp_vm1/vm/qmp.sock", '
        '"console": "/tmp/drv/gen/data2/replicas/rp_vm1/vm/console.log", "served_model": null, '
        '"detail": "stopped", "started_at": 1796674955.1972446, "stop_requested_at": 1796674955.7370715, '
        '"ended_at": 1796674959.40236, "gpus": [], "cpuset": [1], "oom_kills": 0}'),
}
