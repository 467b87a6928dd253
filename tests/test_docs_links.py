"""README.md and docs/ name only result files that exist in benchmarks/results/ (benchmark runs)
or benchmarks/probes/results/ (probe and A/B outputs; an older run they cite is marked "(git
history)"), link only to docs that exist, and name only repository paths that exist. No GPU, no
build."""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
PROBE_RESULTS = ROOT / "benchmarks" / "probes" / "results"
RESULT_PREFIXES = ("kernel", "controls", "tp", "topk", "decode", "gemm_probe", "ncu", "stages", "profile",
                   "ab", "power", "stage2", "logprobs", "penalties", "speculative")


def result_pattern(span: str) -> str | None:
    """The glob in benchmarks/results/ a backticked span names, or None if it names no result file."""
    if "<" in span or " " in span or span.endswith(".py"):
        return None
    name = span.split("results/")[-1] if "results/" in span else span
    if "/" in name or not name.startswith(RESULT_PREFIXES) or "_" not in name:
        return None
    name = re.sub(r"\{[^}]*\}", "*", name)
    if not name.endswith("*") and not re.search(r"\.(json|md|png|txt)$", name):
        return None
    return name


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_result_files_named_exist(doc):
    text = doc.read_text()
    missing = []
    for match in re.finditer(r"`([^`\n]+)`( \(git history\))?", text):
        pattern = result_pattern(match.group(1))
        span = match.group(1)  # a bare name may be in either folder
        folders = [PROBE_RESULTS] if "probes/results/" in span else [RESULTS] if "results/" in span else [
            RESULTS, PROBE_RESULTS]
        if pattern and not match.group(2) and not any(glob.glob(str(folder / pattern)) for folder in folders):
            missing.append(match.group(1))
    assert not missing, f"{doc.name} names result files that are not where they say: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_links_and_paths_exist(doc):
    text = doc.read_text()
    missing = [link for link in re.findall(r"\]\(([^)#]+)\)", text)
               if not link.startswith("http") and not (doc.parent / link).exists()]
    for path in re.findall(r"`((?:csrc|flashsampling_cuda|benchmarks|tests|tools|scripts|docs)/[A-Za-z0-9_./]+)`", text):
        if "*" not in path and not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
