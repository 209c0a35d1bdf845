"""Tuning tables: which kernel (or the fallback) serves each projection problem and M bucket.

One JSON per GPU under tuning/, written by ``dflashgen tune``. A table carries a fingerprint of the
machine and library it was measured on; the runtime refuses a table whose fingerprint does not
match the GPU at hand (never silently using another GPU's choices). Dispatch is TurboMind-style:
per GEMM descriptor a sorted list of tuned M buckets, the nearest bucket M >= requested wins.

Schema (version 1)::

  {"schema": 1, "tuned": true|false, "note": str,
   "fingerprint": {"gpu", "arch", "sms", "driver", "cuda", "torch", "dflashgen", "kernel_library"},
   "problems": {"sm90/nvfp4/store/n14336/k5120": {
       "kplan": {"split_k", "warps_k", "k_group"},
       "buckets": [{"m": 8, "path": "kernel"|"fallback", "kernel": name|null, "us": float|null,
                    "baseline": str|null, "baseline_us": float|null, "noise_us": float|null, "why": str}]}}}
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
FINGERPRINT_KEYS = ("gpu", "arch", "sms", "driver", "cuda", "torch", "dflashgen", "kernel_library")
# Keys whose mismatch makes a table unusable. torch/driver drift only warns: the kernels do not
# depend on them, and a driver update must not silently disable every tuned kernel.
STRICT_KEYS = ("gpu", "arch", "sms", "dflashgen", "kernel_library")


class TableError(ValueError):
    """A tuning table is corrupt, of another schema, or from another GPU / library build."""


def problem_key(arch: int, fmt: str, epilogue: str, n: int, k: int) -> str:
    return f"sm{arch}/{fmt}/{epilogue}/n{n}/k{k}"


def slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


@dataclass(frozen=True)
class Choice:
    path: str  # "kernel" | "fallback"
    kernel: str | None
    bucket_m: int
    why: str
    # the L2 prefetch depth the tuner measured best for this bucket's kernel (sm_90; None: the
    # runtime's default rule, runtime/kernels.py)
    prefetch: int | None = None


class TuningTable:
    def __init__(self, data: dict[str, Any], source: str = "<dict>") -> None:
        self.source = source
        self.data = data
        self._validate()
        self._index: dict[str, tuple[list[int], list[dict[str, Any]]]] = {}
        for key, prob in data["problems"].items():
            buckets = sorted(prob["buckets"], key=lambda b: b["m"])
            self._index[key] = ([b["m"] for b in buckets], buckets)

    def _fail(self, msg: str) -> None:
        raise TableError(f"tuning table {self.source}: {msg}")

    def _validate(self) -> None:
        d = self.data
        if not isinstance(d, dict):
            self._fail("not a JSON object")
        if d.get("schema") != SCHEMA:
            self._fail(f"schema {d.get('schema')!r}, this dflashgen reads schema {SCHEMA}")
        fp = d.get("fingerprint")
        if not isinstance(fp, dict) or any(k not in fp for k in FINGERPRINT_KEYS):
            self._fail(f"fingerprint must have {', '.join(FINGERPRINT_KEYS)}")
        probs = d.get("problems")
        if not isinstance(probs, dict):
            self._fail("'problems' missing")
        for key, prob in probs.items():
            buckets = prob.get("buckets") if isinstance(prob, dict) else None
            if not buckets or not isinstance(buckets, list):
                self._fail(f"{key}: no buckets")
            seen = set()
            for b in buckets:
                if not isinstance(b, dict) or not isinstance(b.get("m"), int) or b["m"] < 1:
                    self._fail(f"{key}: bad bucket {b!r}")
                if b["m"] in seen:
                    self._fail(f"{key}: bucket M={b['m']} twice")
                seen.add(b["m"])
                if b.get("path") not in ("kernel", "fallback"):
                    self._fail(f"{key}: bucket M={b['m']} path must be 'kernel' or 'fallback'")
                if b["path"] == "kernel" and not b.get("kernel"):
                    self._fail(f"{key}: bucket M={b['m']} names no kernel")
                pf = b.get("prefetch_groups")
                if pf is not None and (not isinstance(pf, int) or isinstance(pf, bool) or pf < 0):
                    self._fail(f"{key}: bucket M={b['m']} prefetch_groups must be an integer >= 0, got {pf!r}")

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.data["fingerprint"]

    @property
    def tuned(self) -> bool:
        return bool(self.data.get("tuned", False))

    @classmethod
    def load(cls, path: Path) -> TuningTable:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TableError(f"tuning table {path} does not exist") from None
        except (OSError, ValueError) as e:
            raise TableError(f"tuning table {path} is not valid JSON: {e}") from e
        return cls(data, str(path))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)

    def mismatches(self, here: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Fingerprint keys that differ: {key: (table, here)}. A None in an untuned (heuristic)
        table means 'any': such a table is bound to an arch and a kernel library only."""
        return {k: (self.fingerprint.get(k), here.get(k)) for k in FINGERPRINT_KEYS
                if k in here and self.fingerprint.get(k) != here.get(k)
                and not (self.fingerprint.get(k) is None and not self.tuned)}

    def check_matches(self, here: dict[str, Any]) -> list[str]:
        """Raise TableError on a strict mismatch; return warnings for soft ones."""
        diff = self.mismatches(here)
        strict = {k: v for k, v in diff.items() if k in STRICT_KEYS}
        if strict:
            detail = "; ".join(f"{k}: table {a!r} vs here {b!r}" for k, (a, b) in strict.items())
            self._fail(f"made for another GPU or kernel library ({detail}); run `dflashgen tune` on this GPU")
        return [f"{k}: table {a!r} vs here {b!r}" for k, (a, b) in diff.items()]

    def lookup(self, key: str, m: int) -> Choice:
        """Nearest tuned bucket with M >= m; beyond the largest bucket, or for an unknown
        problem, the fallback."""
        if key not in self._index:
            return Choice("fallback", None, m, f"{key} not in the table")
        ms, buckets = self._index[key]
        i = bisect.bisect_left(ms, m)
        if i == len(ms):
            return Choice("fallback", None, m, f"M={m} above the largest tuned bucket {ms[-1]}")
        b = buckets[i]
        return Choice(b["path"], b.get("kernel"), b["m"], b.get("why", ""), b.get("prefetch_groups"))

    def problems(self) -> dict[str, Any]:
        return self.data["problems"]
