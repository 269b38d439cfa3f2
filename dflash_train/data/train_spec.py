"""`data.train` as sources and sample counts: parsed with the standard library only, so the config
is validated (dflash_train/validate.py) before torch or any model is loaded."""

from __future__ import annotations

import re
from pathlib import Path

SYNTHESIZE = "synthesize"
CODE = "code"
CORPUS_SOURCES = ("default", "chitchat", CODE)
"""Named sources read from what is installed (data/corpus.py, data/code_requests.py), as conversations."""
NAMED_SOURCES = (*CORPUS_SOURCES, SYNTHESIZE)


def parse_train_spec(spec: str, max_samples: int | None) -> list[tuple[str, int | None]]:
    """`data.train` as (source, sample count) pairs, validated before anything heavy loads.

    Syntax: one source (`default`, `chitchat`, `code`, `synthesize`, a JSONL/parquet file or an HF dataset
    directory), or a mix `source:weight,source:weight,...` (a missing weight is 1). A mix, and any
    spec with `synthesize`, needs `max_samples`: it is the total, split by weight (largest
    remainder, so the counts add up exactly). A spec naming an existing path is one source, even
    with a comma or colon in it.
    """
    if not spec.strip():
        raise ValueError("data.train is empty; expected a source or a mix like default:0.5,synthesize:0.5")
    parts = [spec] if Path(spec).expanduser().exists() else [p.strip() for p in spec.split(",")]
    shares = []
    for part in parts:
        name, weight = part, 1.0
        head, sep, tail = part.rpartition(":")
        if sep and re.fullmatch(r"[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?", tail, re.IGNORECASE):
            name, weight = head.strip(), float(tail)
        if weight <= 0:
            raise ValueError(f"data.train={spec!r}: weight of {name!r} must be > 0")
        if name not in NAMED_SOURCES and not Path(name).expanduser().exists():
            where = spec if name == spec.strip() else f"{spec}: {name}"
            raise ValueError(f"data.train={where}: no such file or directory, and not a named source (sources: "
                             f"{', '.join(NAMED_SOURCES)}, or an existing JSONL/parquet file or dataset directory)")
        shares.append((name, weight))
    names = [n for n, _ in shares]
    if len(set(names)) < len(names):
        raise ValueError(f"data.train={spec!r}: a source appears twice")
    if (len(shares) > 1 or SYNTHESIZE in names) and not max_samples:
        raise ValueError(f"data.train={spec!r} needs data.max_samples: the number of samples in all "
                         f"({'split by weight' if len(shares) > 1 else 'prompts the target writes'})")
    if len(shares) == 1:
        return [(names[0], max_samples)]
    total = sum(w for _, w in shares)
    exact = [max_samples * w / total for _, w in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:max_samples - sum(counts)]:
        counts[i] += 1
    return list(zip(names, counts))
