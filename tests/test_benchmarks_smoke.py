"""The serving benchmarks (bench_logprobs.py, bench_penalties.py, bench_speculative.py) end to
end in their --tiny mode on the CPU: each runs in a subprocess, every contender gives a time (no
record has an error), and the results files hold the records, the check lines and the table.
No GPU, no build beyond the CPU extension; a few seconds each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = {"logprobs": "variant", "penalties": "form", "speculative": "drafts"}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_tiny_run_writes_every_contender(name, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"bench_{name}.py"), "--tiny", "--cpu",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("|"), "the markdown table is printed last"
    (result,) = tmp_path.glob(f"{name}_CPU_*_tiny.json")
    results = json.loads(result.read_text())
    records = results["records"]
    assert records and all(BENCHMARKS[name] in r for r in records)
    assert [r for r in records if "errors" in r] == []
    assert all(r["ours_us"] > 0 and r["plain_us"] > 0 and r["ours_over_plain"] > 0 for r in records)
    assert any(k.endswith("_over_ours") and v for r in records for k, v in r.items()), "a baseline ratio"
    assert results["compile"] == {"enabled": False, "reason": "CPU run: the baselines run eagerly", "failed": {}}
    assert results["flashinfer"]["available"] is False and results["flashinfer"]["reason"]
    assert {"device", "date", "command", "commit", "torch"} <= results.keys()
    assert results["checks"] and all(": " in c for c in results["checks"])
    table = result.with_suffix(".md").read_text()
    assert table.startswith("Command: `") and "Target checks" in table and "\n| B |" in table
