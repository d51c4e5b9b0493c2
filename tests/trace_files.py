"""Reading the profiler's torch traces back (tests of profiler.py)."""
import gzip
import json
import os


def trace_files(folder) -> list[str]:
    """The trace files in folder, by name."""
    return sorted(name for name in os.listdir(folder) if ".pt.trace.json" in name)


def trace_events(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def range_names(path) -> list[str]:
    """The names of the trace's nanograph ranges, in time order."""
    events = [e for e in trace_events(path) if e.get("name", "").startswith("nanograph.") and e.get("ph") == "X"]
    return [e["name"] for e in sorted(events, key=lambda e: e["ts"])]
