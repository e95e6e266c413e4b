"""The CPU smoke modes of the throughput benchmarks run end to end and report what they claim to
(benchmarks/multi_gpu.py and benchmarks/fidelity.py have their own tests under tests/parallel, tests/eval)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.forked_python import run_python

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))
# the run line every benchmark prints before its numbers (benchmarks/_runinfo.py): what BENCHMARKS.md records
HEADER = re.compile(r"^run: \d{4}-\d\d-\d\d \d\d:\d\d UTC, commit \S+.*; `python benchmarks/", re.M)


def _run(args, cwd, env=None, fresh=False):
    """`python ARGS` in a process of its own: forked from the suite's preloaded server (tests/forked_python.py), or
    a fresh interpreter (``fresh``: what its import-time switches, TRITON_INTERPRET, must decide)."""
    if fresh:
        proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    else:
        proc = run_python(args, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script", BENCHMARKS)
def test_help_says_what_the_benchmark_measures(script, tmp_path):
    """--help of every benchmark works and opens with its module docstring's first line (what it measures)."""
    out = _run([str(REPO / "benchmarks" / script), "--help"], tmp_path)
    src = (REPO / "benchmarks" / script).read_text()
    first = " ".join(src.split('"""')[1].strip().splitlines()[0].split())
    assert first[:60] in " ".join(out.split()), out[:800]


GPU_MODES = [  # a GPU mode of each benchmark, as BENCHMARKS.md runs it
    ["ssd.py"], ["ssd.py", "--quick", "--ours-only"], ["ssd.py", "--sweep", str(REPO / "benchmarks" / "sweeps" / "caps_ab.txt")],
    ["ssd_host.py"], ["ssd_ncu.py"], ["ssd_gpu_check.py", "--quick"], ["ssd_long_check.py"],
    ["cache_throughput.py", "--device", "cuda"], ["decode.py"], ["multi_gpu.py", "--part", "comm"],
    ["fidelity.py", "--out", "fid"], ["compat_check.py"], ["glue.py"], ["train_throughput.py"],
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA answers")
@pytest.mark.parametrize("cmd", GPU_MODES, ids=lambda c: " ".join(a.rsplit("/", 1)[-1] for a in c))
def test_gpu_modes_stop_at_once_without_cuda(cmd, tmp_path):
    """Without a GPU each GPU mode stops within seconds with one line saying what it needs: no traceback, and no
    CPU run whose numbers would read like the GPU's (decode.py and multi_gpu.py used to run 160m / 410m on the CPU,
    fidelity.py to prepare its data and pretrain its teacher first, the SSD scripts to end in a torch traceback)."""
    proc = run_python([REPO / "benchmarks" / cmd[0], *cmd[1:]], cwd=tmp_path, timeout=120)
    lines = [s for s in proc.stderr.splitlines() if s.strip() and "Warning" not in s and not s.startswith(" ")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and re.search(r"GPU|CUDA", lines[0]), proc.stderr[-3000:]
    assert "|" not in proc.stdout and "tokens/s" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("script,argv,needs", [
    ("ssd.py", [], "--ours-only"), ("ssd_host.py", [], "--no-mamba")])
def test_ssd_benchmarks_stop_without_their_baseline(script, argv, needs, monkeypatch, capsys):
    """On a GPU without mamba_ssm the SSD timings stop before timing anything, saying how to get the baseline
    (the ratios against it are the point) or how to time ours alone; they used to print n/a columns."""
    import importlib.util

    monkeypatch.setattr(sys, "path", [str(REPO / "benchmarks"), *sys.path])
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # not importable, whatever /tmp/anchors holds
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", REPO / "benchmarks" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main()
    msg = str(e.value.code)
    assert "mamba_ssm" in msg and "make gpu-wheels" in msg and needs in msg and "\n" not in msg, msg
    assert "|" not in capsys.readouterr().out


def test_decode_cpu_smoke(tmp_path):
    """decode.py --device cpu at tiny sizes: the teacher and the eager student timed, the run line printed."""
    out = _run([str(REPO / "benchmarks" / "decode.py"), "--device", "cpu", "--flavor", "pythia-nano", "--contexts",
                "16", "32", "--batch", "1", "--new", "2"], tmp_path)
    assert HEADER.search(out) and "decode.py --device cpu --flavor pythia-nano" in out, out
    rows = [r for r in out.splitlines() if r.startswith("| 16 |") or r.startswith("| 32 |")]
    assert len(rows) == 2 and "CPU" in out, out


def test_multi_gpu_smoke_leaves_the_results_alone(tmp_path):
    """--smoke without --out writes no JSON (it used to write CPU numbers to benchmarks/results/multi_gpu.json)."""
    target = REPO / "benchmarks" / "results" / "multi_gpu.json"
    before = target.read_bytes() if target.exists() else None
    out = _run([str(REPO / "benchmarks" / "multi_gpu.py"), "--smoke", "--part", "comm"], tmp_path)
    assert HEADER.search(out) and "all-reduce" in out and "wrote" not in out, out
    assert (target.read_bytes() if target.exists() else None) == before


def test_cache_throughput_smoke(tmp_path):
    # more tokens than the config's default stage-1 budget: the plan must still cover every shard written
    out = _run([str(REPO / "benchmarks" / "cache_throughput.py"), "--smoke", "--tokens", "65536", "--probe-write",
                "--out", str(tmp_path / "o"), "--json", str(tmp_path / "c.json")], tmp_path)
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["verify_ok"] is True and res["written_gb"] > 0 and res["tokens"] == 65536
    assert res["probe_write_gb_s"] > 0 and "write probe" in out
    assert list((tmp_path / "o").iterdir()) == []  # the shards and the probe's files are gone
    # what was written is what the plan said, give or take the tar headers
    assert abs(res["bytes_per_token"] - res["planned_bytes_per_token"]) <= 0.02 * res["planned_bytes_per_token"]
    assert abs(res["written_gb"] - res["planned_gb"]) <= 0.02 * res["planned_gb"]
    assert all(res[k] > 0 for k in ("forward_tok_s", "capture_tok_s", "cache_tok_s"))
    assert "verify" in out
    assert HEADER.search(out) and "`python benchmarks/cache_throughput.py --smoke --tokens 65536" in out, out[:600]


def test_train_throughput_smoke(tmp_path):
    out = _run([str(REPO / "benchmarks" / "train_throughput.py"), "--smoke", "--grad-checks", "hmscale,two-pass,deepspeed", "--gaps",
                "--out", str(tmp_path / "t.json")], tmp_path)
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["model"] for r in rows] == [f"pythia-nano {m}{c}" for m in ("hedgemamba", "teacher-sdpa")
                                          for c in ("", " checks=two-pass", " checks=deepspeed")]
    assert all(r["tokens_per_s"] > 0 and r["final_loss"] > 0 for r in rows)
    for ours, two_pass, loops in (rows[:3], rows[3:]):  # hmscale's gradient checks train exactly as DeepSpeed's loops
        for r in (ours, two_pass):
            assert abs(r["final_loss"] - loops["final_loss"]) <= 1e-5 * loops["final_loss"], (r, loops)
    assert "| pythia-nano hedgemamba |" in out
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d UTC, commit \S+", out, re.M), out[-3000:]  # date, commit
    # --gaps traced each model's step twice (torch ops, Python frames); a CPU trace has no device events
    assert out.count("GPU idle in one step of pythia-nano") == 12 and "no device events in the trace" in out


def test_train_throughput_lora_smoke(tmp_path):
    out = _run([str(REPO / "benchmarks" / "train_throughput.py"), "--smoke", "--lora-rank", "4", "--no-teacher",
                "--out", str(tmp_path / "t.json")], tmp_path)
    (row,) = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["model"] == "pythia-nano hedgemamba lora-r4" and row["mfu"] is None and row["tokens_per_s"] > 0
    assert "| pythia-nano hedgemamba lora-r4 |" in out and "n/a (LoRA)" in out


def test_ssd_registers_reports_every_kernel(tmp_path):
    """benchmarks/ssd_registers.py compiles each launch of one fwd+bwd call for sm_90 on the CPU and reads its
    registers and spill bytes (also when the environment asks for the interpreter, as the test suite does), and
    with --dump writes what it compiled."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="1", HMSCALE_SSD_BWD_PAIR="0")  # dx and dB/dC as two launches
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ssd_registers.py"), "--shape", "410m_norm",
                           "--seq", "128", "--batch", "1", "--only", "dbc,dx_dcs,finish", "--dump", "dump"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r.split("|")[1].strip(): r.split("|") for r in proc.stdout.splitlines() if r.startswith("| _")}
    assert set(rows) == {"_chunk_bwd_dbc", "_chunk_bwd_dx_dcs", "_finish_bwd"}, proc.stdout
    for name, cols in rows.items():
        assert "ERROR" not in "".join(cols), cols
        regs, stack = int(cols[5]), int(cols[6])
        assert 16 <= regs <= 255 and stack >= 0, cols
    assert "Q=64,BP=32,BN=64" in "".join(rows["_chunk_bwd_dbc"])  # the launch's real tiles (the v2 default)
    for name in rows:  # --dump: each kernel's TTGIR, PTX and cubin, for reading the compiler's choices
        assert "tt.func" in (tmp_path / "dump" / f"{name}.ttgir").read_text()
        assert ".entry " + name in (tmp_path / "dump" / f"{name}.ptx").read_text()
        assert (tmp_path / "dump" / f"{name}.cubin").read_bytes()[:4] == b"\x7fELF"
    # by default bf16 heads of 64 channels with the normaliser run both as one paired launch (64 x 64 dx tiles)
    env.pop("HMSCALE_SSD_BWD_PAIR")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ssd_registers.py"), "--shape", "410m_norm",
                           "--seq", "128", "--batch", "1", "--only", "dbc,dx_dcs,pair"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r.split("|") for r in proc.stdout.splitlines() if r.startswith("| _")]
    assert [r[1].strip() for r in rows] == ["_chunk_bwd_pair"], proc.stdout
    assert "ERROR" not in "".join(rows[0]) and "Q=64,BP=64,BN=64" in rows[0][4], rows[0]


def test_ssd_registers_reports_the_glue_kernels(tmp_path):
    """--op conv / fm: the glue's launches compiled for sm_90 with the tiles HMSCALE_*_CFG gives them."""
    import os

    env = dict(os.environ, TRITON_INTERPRET="1", HMSCALE_CONV_CFG="bwd=32,64,4,512")
    for op, names in (("conv", {"_conv_fwd", "_conv_bwd"}), ("fm", {"_fm_fwd", "_fm_bwd"})):
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ssd_registers.py"), "--op", op, "--seq", "64"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = {r.split("|")[1].strip(): r.split("|") for r in proc.stdout.splitlines() if r.startswith("| _")}
        assert set(rows) == names, proc.stdout
        for cols in rows.values():
            assert "ERROR" not in "".join(cols) and 16 <= int(cols[5]) <= 255, cols
        if op == "conv":  # the environment's tiles, not the defaults
            assert "BL=32,BC=64" in rows["_conv_bwd"][4] and rows["_conv_bwd"][2].strip() == "4", rows["_conv_bwd"]


def test_ssd_long_check_smoke(tmp_path):
    """The GPU's long-sequence check on the CPU interpreter (fp32, two heads, two chunks): both pass modes forced,
    every output and gradient within tolerance of the float64 reference, and said so. --device cpu chooses the
    interpreter itself (it used to need TRITON_INTERPRET=1 from the caller, which the suite's conftest hid)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run([str(REPO / "benchmarks" / "ssd_long_check.py"), "--device", "cpu", "--dtype", "fp32", "--heads", "2",
                "--l", "70"], tmp_path, env=env, fresh=True)
    assert HEADER.search(out), out
    rows = [line for line in out.splitlines() if line.startswith("| 1.4b") or line.startswith("| 410m")]
    assert [r.split("|")[3].strip() for r in rows] == ["fused", "split", "fused", "split"], out
    assert "PASS: worst relative error" in out


def test_ssd_gpu_check_on_the_cpu(tmp_path):
    """ssd_gpu_check.py --cpu --case: chosen grid cases under the interpreter, each output's error printed, exit 0
    when within the dtype's limit; an unknown option set is a one-line error."""
    out = _run([str(REPO / "benchmarks" / "ssd_gpu_check.py"), "--cpu", "--dtypes", "fp32,bf16", "--l", "70",
                "--case", "32,16,2,norm+init+seq+D", "--seeds", "0,1"], tmp_path)
    assert HEADER.search(out) and "TRITON_INTERPRET=1" in out, out
    lines = [s for s in out.splitlines() if s.startswith("seed ")]
    assert len(lines) == 4 and not any("FAIL" in s for s in lines), out
    for s in lines:  # every gradient of this option set, with an error well inside the fp32 / bf16 limits
        errs = dict(zip(s.split(": ")[1].split()[::2], map(float, s.split(": ")[1].split()[1::2])))
        assert set(errs) == {"y", "final", "dx", "ddt", "dA", "dB", "dC", "dD", "dinitial_state"}, s
        assert max(errs.values()) < (1e-4 if "float32" in s else 1e-2), s
    proc = run_python([REPO / "benchmarks" / "ssd_gpu_check.py", "--cpu", "--case", "32,16,2,everything"], cwd=tmp_path)
    assert proc.returncode != 0 and "options must be one of" in proc.stderr


def test_compat_check_verdict_allows_for_the_baseline_own_error():
    """benchmarks/compat_check.py: the two implementations must agree within the limit, unless mamba_ssm itself is
    further from float64 than that (its fp32 dots run as TF32 on the H200: 1.4e-3), and then ours must be exact."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compat_check", REPO / "benchmarks" / "compat_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.agree(5e-5, 1e-6, 1e-6, 1e-4)  # plain agreement
    assert mod.agree(1.48e-3, 2.8e-6, 1.48e-3, 1e-4)  # the H200's fp32 rows: the baseline's own error
    assert not mod.agree(1.48e-3, 1.4e-3, 2e-6, 1e-4)  # ours is the one off
    assert not mod.agree(5e-3, 2.8e-6, 1.48e-3, 1e-4)  # more than the baseline's error explains
    assert not mod.agree(float("nan"), 1e-6, 1e-6, 1e-4)


@pytest.mark.skipif(not list((REPO / ".anchors").glob("mamba_ssm-*.tar.gz")) or Path("/tmp/anchors/mamba_ssm").exists(),
                    reason="needs .anchors/mamba_ssm-*.tar.gz (`make gpu-wheels`) and no /tmp/anchors")
def test_compat_check_removes_its_unpacked_baseline(tmp_path):
    """compat_check.py --cpu unpacks mamba_ssm from .anchors/ into a temporary folder; it is gone after the run
    (every run used to leave one behind in /tmp)."""
    code = ("import importlib.util, sys; sys.argv = ['compat_check.py', '--cpu']; "
            f"spec = importlib.util.spec_from_file_location('cc', {str(REPO / 'benchmarks' / 'compat_check.py')!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(m.unpack_mamba())")
    out = _run(["-c", code], tmp_path).strip().splitlines()[-1]
    assert Path(out).name.startswith("mamba_ssm_") and not Path(out).exists(), out


def test_the_run_line_names_settings_not_a_one_process_groups_port(monkeypatch):
    """A process that trained in-process (its one-process group: init_distributed records the port it chose in
    HMSCALE_SINGLE_PROCESS_GROUP_PORT for its children) printed that variable in every later run line, as a setting."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from _runinfo import command
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    monkeypatch.setenv("HMSCALE_SINGLE_PROCESS_GROUP_PORT", "41599")
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    monkeypatch.setenv("HMSCALE_SSD_PASS", "fused")
    assert command([str(REPO / "benchmarks" / "ssd.py"), "--sweep", "x.txt"]) == \
        "HMSCALE_SSD_PASS=fused python benchmarks/ssd.py --sweep x.txt"


def test_cache_throughput_published_shape_layer_subset(tmp_path):
    # a published flavour's shape with a layer past the miniature's count (the layer-parallel worker's spec): the
    # config is checked against that teacher's layers, not the miniature's
    out = _run([str(REPO / "benchmarks" / "cache_throughput.py"), "--device", "cpu", "--flavor", "pythia-70m",
                "--layers", "4", "--tokens", "256", "--seq-len", "64", "--sequences-per-shard", "2", "--host-only",
                "--no-forward", "--json", str(tmp_path / "c.json")], tmp_path)
    res = json.loads((tmp_path / "c.json").read_text())
    assert "1 of 6 layers [4]" in out, out[-1500:]
    assert res["verify_ok"] is True and res["tokens"] == 256
    assert abs(res["bytes_per_token"] - res["planned_bytes_per_token"]) <= 0.05 * res["planned_bytes_per_token"]
