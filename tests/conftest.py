"""Suite-wide settings: CPU only, deterministic, small thread pools (CI has 2 cores)."""

import os
import sys

# Triton kernels run under the interpreter on CPU; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one thread per process: `make test` runs two pytest workers on CI's two cores, and the tests' subprocesses (Ray
# workers, benchmark smokes, multi-rank jobs) inherit this; more busy threads than cores only spin and wait (the
# fidelity smoke took 164 s beside the Ray tests with two threads, 33 s with one; the suite 14:54 -> 14:13)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train (the Ray tests' TorchTrainer runs): its controller takes in one worker report per poll, every 2 s by
# default, so a short run's checkpoint reports queue up behind it (a worker's report waits for the previous one to be
# taken: the kill-and-resume test waited ~20 s on that at 2 s, and took 3-6 s longer at 0.5 s than at 0.1 s; a poll a
# busy worker misses is only waited on: Ray Train calls a worker hung after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S,
# 10 min); and each worker group start adds a preemption-watcher actor (one more Python process), useless on one local
# node that is never drained. Both settings reach the controller and the workers from the driver's environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# this environment's bin directory first on PATH, as in an activated venv, for every process of the suite: the Ray job
# of tests/cli/test_submit.py needs it (its `python`), and then everything must see the same `ninja`. DeepSpeed JIT-builds
# its CPU all-reduce op into one shared ~/.cache/torch_extensions; the venv's ninja (1.13) and a system one (1.11 here)
# hash the build log's commands differently, so each takes the other's build for stale and compiles it again (~45 s
# on both cores, with every DeepSpeed start in the suite waiting on the build lock); that happened 2-4 times a run
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`) every test that starts a Ray
    cluster goes to one worker, one at a time: two local clusters at once on a 2-core machine only slow
    each other down (raylets, GCS and workers competing for the cores, and Ray's start-up timeouts)."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _group_node_ids(items)


def _group_node_ids(items):
    """xdist (3.8) tells its controller an item's group by renaming it `<nodeid>@<group>` through `item._nodeid`;
    pytest 9.2 keeps the id in `item._id` (a structured NodeId) instead, so that rename does nothing and every
    group is scattered over the workers (pytest-dev/pytest-xdist#1386). Where the rename did not take, make it
    here: the same string id, parsed as pytest parses any string node id."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # an older pytest: xdist's own rename works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if names and isinstance(getattr(item, "_id", None), NodeId) and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# One embedded Ray cluster for each run of consecutive Ray tests (under xdist: the whole "ray" group, on one worker)
# instead of one per module or test: a cluster start is ~8-12 s of both cores here, and its shutdown ~2 s more. It is
# started as the product starts its own (hmscale.ray_cluster.connect: dashboard, job API and Ray Train's state API on
# 127.0.0.1), with 2 CPUs (2 teacher-forward actors, 2 Ray Train workers, 2 sweep sizes at once), and stopped as soon
# as the next test is not a Ray test, so it never idles beside the rest of the suite. A test that leaves CPUs taken
# (an actor or placement group it did not release) ends the cluster, and the next test gets a fresh one.
class _SharedRay:
    def __init__(self):
        self.ours = False

    def start(self):
        import ray

        if not ray.is_initialized():
            from hmscale.ray_cluster import connect

            saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "HMSCALE_NO_PROGRESS")}
            os.environ.pop("RAY_ADDRESS", None)  # a cluster of our own (address="local"), never another one on the host
            os.environ["HMSCALE_NO_PROGRESS"] = "1"  # the cluster's processes inherit the environment they start with
            try:
                connect(num_cpus=2, log=lambda *a, **k: None)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            self.ours = True
        return ray

    def settle(self, timeout: float = 30.0):
        """After a test: wait for every CPU to come back (Ray releases actors and placement groups asynchronously)."""
        import time

        import ray

        if not (self.ours and ray.is_initialized()):
            return
        total, deadline = ray.cluster_resources().get("CPU", 0), time.time() + timeout
        while ray.available_resources().get("CPU", 0) < total:
            if time.time() > deadline:
                self.stop()
                return
            time.sleep(0.2)

    def stop(self):
        if self.ours and "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        self.ours = False


_RAY = _SharedRay()


@pytest.fixture
def ray_cluster():
    """The embedded local Ray cluster (2 CPUs) shared by consecutive Ray tests; yields the `ray` module."""
    yield _RAY.start()
    _RAY.settle()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if _RAY.ours and (nextitem is None or nextitem.get_closest_marker("ray") is None):
            _RAY.stop()
        _check_tie_weights(item)


_TIE_WEIGHTS: list = []  # transformers' PreTrainedModel.tie_weights, as last seen unpatched


def _tie_weights_patched() -> bool:
    """Whether transformers' PreTrainedModel.tie_weights is its load-time no-op now (remembering it while it is not)."""
    mu = sys.modules.get("transformers.modeling_utils")
    cur = mu.PreTrainedModel.__dict__.get("tie_weights") if mu is not None else None
    if cur is None or getattr(cur, "__name__", "") != "empty_func":
        if cur is not None:
            _TIE_WEIGHTS[:] = [cur]
        return False
    return True


def pytest_runtest_setup(item):
    _tie_weights_patched()


def _check_tie_weights(item) -> None:
    """transformers' from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads and puts back what
    it found: two loads overlapping in threads leave the no-op for good, and every later tied model of this worker
    comes out untied (a full run of 2026-12-06 failed so in a later test; hmscale.hf_load now serialises the product's
    loads). Restore it, and name the test it happened in (pytest's warnings summary)."""
    if _tie_weights_patched() and _TIE_WEIGHTS:
        sys.modules["transformers.modeling_utils"].PreTrainedModel.tie_weights = _TIE_WEIGHTS[0]
        import warnings

        warnings.warn(f"{item.nodeid} left transformers' PreTrainedModel.tie_weights patched to a no-op (restored)")


# DeepSpeed's CPU all-reduce leaves one /dev/shm file per rank of every multi-process group (tens of MB of
# memory each); the product removes its own (hmscale.train.engine.remove_shm_buffers), tests that set up
# groups by hand would leak theirs: remove what this session created.
_SHM = "/dev/shm"


def _shm_buffers() -> set:
    try:
        return {f for f in os.listdir(_SHM) if f.startswith("deepspeed_allreduce_buffer_")}
    except OSError:
        return set()


_SHM_AT_START = _shm_buffers()


def pytest_sessionfinish(session, exitstatus):
    _RAY.stop()
    for name in _shm_buffers() - _SHM_AT_START:
        try:
            os.unlink(os.path.join(_SHM, name))
        except OSError:
            pass
