"""The papers' published figures that the benchmarks print beside ours, each labelled by its source.

Nothing here is measured by this project. Every row carries one of SOURCES:
- "abstract": what the paper's abstract says (the CAMG abstract gives a claim, no numbers);
- "released figures": the authors' released result tables and figure files;
- "derived": computed here from released figures (an average, a released row minus a released
  ablation cost). The authors never printed such a number: it is not "reported".
A row whose figures are released but one of whose columns is computed here names that column in
`derived` (e.g. CompactionRL's average); its source cell reads "released figures; Avg derived".
"""

SOURCES = ("abstract", "released figures", "derived")

# RIME paper (Codebase Adaptation, the 19-task test stream): its results table.
# (row, cumulative reward, cumulative gain, source)
RIME_CODEBASE19 = [
    ("Qwen3.5-4B + RIME", 10.55, 2.27, "released figures"),
    ("GPT-5.4", 10.14, 0.69, "released figures"),
    ("Claude Opus 4.7", 10.36, 1.49, "released figures"),
    ("GPT-6 Astra", 17.25, 2.26, "released figures"),
    ("Claude Opus 5.5", 17.40, 0.90, "released figures"),
]

# CAMG paper: success (%) on 128 test tasks per environment, greedy, 4B models (its Table 2 and its
# memory ablations). dict(row, values {column: %}, source, derived: the columns computed here).
CAMG_COLUMNS = ("shop", "coding", "deepresearch", "autoresearch", "avg")
CAMG_TITLES = {"shop": "Shop", "coding": "Coding", "deepresearch": "DeepResearch", "autoresearch": "AutoResearch",
               "avg": "Avg"}
BLANK_COST = {"shop": 29.4, "coding": 13.8, "deepresearch": 4.8, "autoresearch": 8.3}   # points lost, released
_CAMG_4B = {"shop": 97.1, "coding": 26.6, "deepresearch": 55.5, "autoresearch": 38.3, "avg": 54.4}
_COMPACTION = {"shop": 97.5, "coding": 19.5, "deepresearch": 50.8, "autoresearch": 24.2}
_BLANKED = {env: round(_CAMG_4B[env] - cost, 1) for env, cost in BLANK_COST.items()}
CAMG_SUCCESS = [
    dict(row="CAMG-RL-4B", values=_CAMG_4B, source="released figures", derived=()),
    dict(row="CompactionRL-4B", values={**_COMPACTION, "avg": round(sum(_COMPACTION.values()) / 4, 1)},
         source="released figures", derived=("avg",)),
    dict(row="Qwen3.5-4B (frozen)", values={"shop": 11.6, "coding": 10.9, "deepresearch": 36.7, "autoresearch": 10.2,
                                            "avg": 17.4}, source="released figures", derived=()),
    dict(row="CAMG-RL-4B, cost of blank saved memory at evaluation (points)", values=BLANK_COST,
         source="released figures", derived=()),
    dict(row="CAMG-RL-4B, blank saved memory at evaluation", values={**_BLANKED, "avg": round(sum(_BLANKED.values()) / 4, 1)},
         source="derived", derived=()),      # CAMG-RL-4B minus the cost above, per environment; their mean
    dict(row="CAMG-RL-4B, trained with only the continuation file", values={"avg": 41.8},
         source="released figures", derived=()),
    dict(row="CAMG-RL-4B, no gradients through memory actions", values={"avg": 21.1},
         source="released figures", derived=()),
]

# CAMG paper: the two external benchmarks, the figures as released (the abstract's claim in words)
CAMG_EXTERNAL_COLUMNS = ("SWE-bench Verified", "MLE-bench Lite")
CAMG_EXTERNAL = [
    ("CAMG-RL-4B", (15.8, 4.5), "released figures"),
    ("CAMG-RL-9B", (27.6, 9.1), "released figures"),
    ("Qwen3.5-35B-A3B", ("competitive with CAMG-RL-4B",) * 2, "abstract"),
    ("Qwen3.5-122B-A10B", ("competitive with CAMG-RL-9B",) * 2, "abstract"),
]
CAMG_ABSTRACT_CLAIM = ("On SWE-bench Verified and MLE-bench Lite, CAMG-RL-4B and CAMG-RL-9B are competitive with "
                       "Qwen3.5-35B-A3B and Qwen3.5-122B-A10B, respectively.")


def source_cell(row: dict) -> str:
    """The source column of a CAMG_SUCCESS row: its source, and the columns computed here if any."""
    extra = ", ".join(CAMG_TITLES[c] for c in row["derived"])
    return row["source"] + (f"; {extra} derived" if extra else "")


def camg_row(name: str) -> dict:
    return next(r for r in CAMG_SUCCESS if r["row"] == name)


def camg_tables() -> str:
    """The CAMG paper's published figures as markdown: success per environment, the external benchmarks,
    and the abstract's claim in its own words."""
    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)
    lines = ["| published row (CAMG paper), success % | " + " | ".join(CAMG_TITLES[c] for c in CAMG_COLUMNS)
             + " | source |", "|---" + "|---:" * len(CAMG_COLUMNS) + "|---|"]
    for r in CAMG_SUCCESS:
        cells = [fmt(r["values"][c]) if c in r["values"] else "—" for c in CAMG_COLUMNS]
        lines.append(f"| {r['row']} † | " + " | ".join(cells) + f" | {source_cell(r)} |")
    lines += ["", "| published row (CAMG paper) | " + " | ".join(CAMG_EXTERNAL_COLUMNS) + " | source |",
              "|---|---|---|---|"]
    lines += [f"| {name} † | " + " | ".join(fmt(v) for v in vals) + f" | {src} |" for name, vals, src in CAMG_EXTERNAL]
    lines += ["", f"The CAMG paper's abstract: \"{CAMG_ABSTRACT_CLAIM}\"",
              "† published, not measured here. released figures: the authors' released result tables; derived: "
              "computed here from them (e.g. the blanked row = CAMG-RL-4B minus the released cost, per environment)."]
    return "\n".join(lines)
