"""The parity matrix: every decoder family we claim x every layout we offer trains equal to one process, or
accelerate() refuses it up front with the same ValueError on every rank.

``CELLS`` below is the one statement of what each cell gives (docs/parity.md shows it, and a test keeps
the two equal); matrix_scenarios.py builds the families and runs the layouts. One launch per world size runs
every layout of that size, each with every family in both init variants; one test per cell and variant reads
it, so a failure names its cell.
The one-process references run here, once per family and variant, shared by every layout.

A cell that a known defect breaks today is ``xfail(strict=True)``: when the fix lands, the cell passes,
the mark fails the suite, and the entry in ``DEFECTS`` must go (with the docs table, which says so).

To add a layout: one ``LAYOUTS`` entry in matrix_scenarios.py and its column in ``CELLS``.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import matrix_scenarios as scenarios
import pytest
import torch
from _launch import launch
from matrix_scenarios import FAMILIES, LAYOUTS, VARIANTS

SCENARIOS = str(Path(__file__).with_name("matrix_scenarios.py"))
DOCS = Path(__file__).resolve().parents[2] / "docs" / "parity.md"
TOL = 5e-5  # on every loss and every element of the final full state


@dataclass(frozen=True)
class Verified:
    """Trains equal to one process on the same global batches."""


@dataclass(frozen=True)
class Refused:
    """accelerate() raises a ValueError matching ``match`` on every rank, before any collective."""

    match: str
    why: str  # for the docs


@dataclass(frozen=True)
class Defect:
    """A known defect that breaks the cells it names today (None: every layout, family or variant)."""

    reason: str  # the xfail reason: what is wrong, and where it is tracked
    summary: str  # for the docs
    layouts: frozenset[str] | None = None
    families: frozenset[str] | None = None
    variants: frozenset[str] | None = None

    def breaks(self, layout: str, family: str, variant: str) -> bool:
        return all(
            names is None or name in names
            for names, name in ((self.layouts, layout), (self.families, family), (self.variants, variant))
        )


VERIFIED = Verified()
TP_LAYOUTS = frozenset(name for name, layout in LAYOUTS.items() if layout.settings.get("dist.tp.size", 1) > 1)
CONV1D = Refused(
    r"dist\.tp\.plan: transformer\.h\.0\.attn\.c_attn is a transformers Conv1D .* use FSDP for this model",
    "GPT-2's layers are transformers `Conv1D` (weight stored transposed), which no TP style splits: use FSDP or HSDP",
)

LOCAL_EXPERTS = Refused(
    r"dist\.tp\.sequence_parallel=True: model\.layers\.0\.mlp\.gate \(a MixtralTopKRouter with parameters\) sits "
    r"inside the blocks but outside dist\.tp\.plan",
    "the router and experts, which the plan leaves whole, would run on this rank's tokens only under sequence "
    "parallelism (each rank would keep its tokens' share of their gradient): TP 2 without SP trains it exactly",
)

PP_LAYOUT = Refused(
    r"dist\.pp\.size > 1 splits Hugging Face decoder-only models .* GPT2LMHeadModel \(blocks in 'transformer\.h'\) "
    r"lacks its blocks in a list named 'layers', an embed_tokens embedding",
    "GPT-2's decoder (`wte` and `wpe`, blocks in `h`, `ln_f`) is not the `embed_tokens`, `layers`, final-norm "
    "decoder the pipeline splits (and its head is tied to its embedding): train it with FSDP or HSDP",
)
PP_TIED = Refused(
    r"dist\.pp: lm_head\.weight is tied to model\.embed_tokens\.weight, but the head lives on the last stage and "
    r"the embedding on the first; untie them",
    "the head shares its weight with the embedding (`tie_word_embeddings=True`, the family's default), but the head "
    "lives on the last stage and the embedding on the first, and the pipeline does not add up the two stages' "
    "gradients of one weight: untie them (`tie_word_embeddings=False`) or train without PP",
)
PP_COLUMN = {**dict.fromkeys(FAMILIES, VERIFIED), "gpt2": PP_LAYOUT, "gemma": PP_TIED, "gemma2": PP_TIED}

# What each cell gives: layout -> family -> outcome. A cell broken by a known defect says what it must give.
CELLS: dict[str, dict[str, Verified | Refused]] = {
    "fsdp2": dict.fromkeys(FAMILIES, VERIFIED),
    "hsdp2x2": dict.fromkeys(FAMILIES, VERIFIED),
    "tp2": {**dict.fromkeys(FAMILIES, VERIFIED), "gpt2": CONV1D},
    "tp2_sp": {**dict.fromkeys(FAMILIES, VERIFIED), "gpt2": CONV1D, "mixtral": LOCAL_EXPERTS},
    "fsdp2_tp2": {**dict.fromkeys(FAMILIES, VERIFIED), "gpt2": CONV1D},
    "pp2": PP_COLUMN,
    "pp2_fsdp2": PP_COLUMN,
    "cp2": dict.fromkeys(FAMILIES, VERIFIED),
    "cp2_fsdp2": dict.fromkeys(FAMILIES, VERIFIED),
}

# The families whose own plan (dist.tp.plan="auto") torchacc refuses, so that the matrix uses a dict plan.
OWN_PLAN_REFUSED: dict[str, Refused] = {
    "gpt2": Refused(
        r"dist\.tp\.plan='auto' takes a Hugging Face model's own plan .* GPT2LMHeadModel has none",
        "GPT-2 has no plan of its own",
    ),
    "mixtral": Refused(
        r"dist\.tp\.plan\['model\.layers\.\*\.mlp\.experts\.gate_up_proj'\]='packed_colwise' \(a layer holding several "
        r"projections\) is not supported",
        "Mixtral's own plan, refused: it splits the packed experts (`packed_colwise`, `moe_tp_experts`), styles "
        "torchacc does not have; the dict plan splits attention, embedding and head, and leaves the router and "
        "experts whole",
    ),
}

DEFECTS: tuple[Defect, ...] = ()  # none known today


def known_defects(layout: str, family: str, variant: str) -> list[Defect]:
    if not isinstance(CELLS[layout][family], Verified):
        return []
    return [defect for defect in DEFECTS if defect.breaks(layout, family, variant)]


def _cases():
    # grouped by world size (one launch each), in the table's order within a group
    for layout in sorted(LAYOUTS, key=lambda name: LAYOUTS[name].world_size):
        for family in FAMILIES:
            for variant in VARIANTS:
                defects = known_defects(layout, family, variant)
                marks = [pytest.mark.xfail(strict=True, reason="; ".join(d.reason for d in defects))] if defects else []
                yield pytest.param(layout, family, variant, marks=marks, id=f"{layout}-{family}-{variant}")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(layout, part)``: each rank's ``part`` ("cells" or "own_plans") of ``layout``.

    One launch per world size runs every layout of that size; the tests run world size by world size, so each
    size launches once, and only the current size keeps its cells.
    """
    cache: dict[int, list[dict]] = {}

    def get(layout: str, part: str = "cells") -> list[dict]:
        size = LAYOUTS[layout].world_size
        if part not in cache.get(size, [{layout: {}}])[0][layout]:
            for other, ranks in cache.items():
                cache[other] = [
                    {
                        name: {key: value for key, value in parts.items() if key != "cells"}
                        for name, parts in rank.items()
                    }
                    for rank in ranks
                ]
            cache[size] = launch(
                f"{SCENARIOS}:run_layouts",
                size,
                tmp_path_factory.mktemp(f"ranks{size}"),
                args=(size,),
                timeout=1200,  # every layout of the size; a hang guard, not a budget
            )
        return [rank[layout][part] for rank in cache[size]]

    return get


@pytest.fixture(scope="module")
def reference():
    cache: dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor]]] = {}

    def get(family: str, variant: str):
        if (family, variant) not in cache:
            cache[family, variant] = scenarios.reference(family, variant)
        return cache[family, variant]

    return get


def _describe(result: dict) -> str:
    if "refused" in result:
        return f"was refused: {result['refused']}"
    if "crashed" in result:
        return f"crashed in training: {result['crashed']}"
    return "trained"


@pytest.mark.parametrize(("layout", "family", "variant"), list(_cases()))
def test_cell(launched, reference, layout, family, variant):
    results = [cells[family, variant] for cells in launched(layout)]
    outcome = CELLS[layout][family]
    if isinstance(outcome, Refused):
        messages = [result.get("refused") for result in results]
        assert messages[0] is not None, f"{family} on {layout} must be refused, but it {_describe(results[0])}"
        assert messages == messages[:1] * len(messages), f"the ranks raised different errors: {messages}"
        assert re.search(outcome.match, messages[0]), messages[0]
        return
    for rank, result in enumerate(results):
        assert "losses" in result, f"rank {rank} {_describe(result)}"
    for rank, result in enumerate(results):  # the layout is in effect: a run of one process would pass the rest
        assert result["axes"] == LAYOUTS[layout].axes, f"rank {rank}: parameters live on the mesh axes {result['axes']}"
        assert result["block_tokens"] == scenarios.SEQ // LAYOUTS[layout].sequence_split, (
            f"rank {rank}: the decoder layers see {result['block_tokens']} tokens of each sequence"
        )
    for step, batch in enumerate(scenarios.global_batches()):
        seen = [i for result in results for i in result["indices"][step]]
        share = len(results) // LAYOUTS[layout].num_data_ranks  # the ranks of a TP group share a batch
        assert sorted(seen) == sorted(batch * share), f"step {step}: the ranks' batches are not the global batch"
    ref_losses, ref_state = reference(family, variant)
    if LAYOUTS[layout].num_stages > 1:
        _assert_stages([result["state"].keys() for result in results], ref_state.keys(), LAYOUTS[layout].num_stages)
    # each data-parallel rank's loss is its own batch's mean, and the batches are equal: their mean is the global loss
    losses = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    worst = (losses - torch.tensor(ref_losses)).abs().max().item()
    assert worst < TOL, f"losses {losses.tolist()} differ from one process's {ref_losses} by {worst:.2e}"
    for rank, result in enumerate(results):
        if LAYOUTS[layout].num_stages == 1:
            assert result["state"].keys() == ref_state.keys(), "accelerate() must keep the state_dict keys"
        diffs = {name: (value - ref_state[name]).abs().max().item() for name, value in result["state"].items()}
        name = max(diffs, key=diffs.get)
        assert diffs[name] < TOL, f"rank {rank}: {name} differs from one process by {diffs[name]:.2e}"


def _assert_stages(keys: list, whole: set[str], num_stages: int) -> None:
    """Under a pipeline each rank holds one stage's part of the state, under the plain model's names: the
    ``num_stages`` parts are disjoint, and together they are the whole model's state."""
    parts = {frozenset(part) for part in keys}
    assert len(parts) == num_stages, f"the ranks hold {len(parts)} different parts of the model, not {num_stages}"
    assert sum(map(len, parts)) == len(set().union(*parts)), "two stages hold the same tensor"
    assert set().union(*parts) == set(whole), "accelerate() must keep the state_dict keys, over the stages"


@pytest.mark.parametrize("family", sorted(OWN_PLAN_REFUSED))
def test_own_plans_the_matrix_does_not_use_are_refused(launched, family):
    messages = [own_plans[family] for own_plans in launched("tp2", "own_plans")]
    assert messages[0] is not None, f"{family}'s own plan is accepted now: use it (tp_plan='auto' in FAMILIES)"
    assert messages == messages[:1] * len(messages), messages
    assert re.search(OWN_PLAN_REFUSED[family].match, messages[0]), messages[0]


def test_every_cell_is_stated():
    assert CELLS.keys() == LAYOUTS.keys(), "every layout needs its column of CELLS, and only those"
    for layout, column in CELLS.items():
        assert column.keys() == FAMILIES.keys(), f"CELLS[{layout!r}] must name every family"
    with_dict_plan = {name for name, family in FAMILIES.items() if family.tp_plan != "auto"}
    assert with_dict_plan == OWN_PLAN_REFUSED.keys(), "a family uses a dict plan only when its own plan is refused"


# ---- the table in docs/parity.md -------------------------------------------------------------------------------

BEGIN, END = "<!-- matrix table: generated from tests/multiproc/test_matrix.py -->", "<!-- end of matrix table -->"
VARIANT_NAMES = {"seeded": "per-rank seeds", "meta": "meta init"}


def render_table() -> str:
    """The family x layout table and its notes, as docs/parity.md shows them between ``BEGIN`` and ``END``."""
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    def cell(layout: str, family: str) -> str:
        outcome = CELLS[layout][family]
        if isinstance(outcome, Refused):
            return f"refused {note(outcome.why)}"
        # the first variant's state, then what the others break beyond it
        first, *others = VARIANTS
        base = known_defects(layout, family, first)
        text = f"defect {' '.join(note(d.summary) for d in base)}" if base else "verified"
        for variant in others:
            extra = [d for d in known_defects(layout, family, variant) if d not in base]
            if extra:
                also = "also " if base else ""
                text += f"; {VARIANT_NAMES[variant]}: {also}defect {' '.join(note(d.summary) for d in extra)}"
        return text

    def plan(family: str) -> str:
        if family not in OWN_PLAN_REFUSED:
            return "own (`auto`)"
        return f"dict {note(OWN_PLAN_REFUSED[family].why)}"

    header = ["family", "TP plan", *(layout.title for layout in LAYOUTS.values())]
    rows = [
        [FAMILIES[family].title, plan(family), *(cell(layout, family) for layout in LAYOUTS)] for family in FAMILIES
    ]
    lines = [BEGIN, "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines += [f"{number}. {text}" for number, text in enumerate(notes, start=1)]
    lines += ["", "| layout | ranks | config |", "| --- | --- | --- |"]
    for layout in LAYOUTS.values():
        settings = ", ".join(f"`{key}={value!r}`" for key, value in layout.settings.items())
        lines.append(f"| {layout.title} | {layout.world_size} | {settings} |")
    lines.append(END)
    return "\n".join(lines)


def test_docs_table_is_the_data():
    text = DOCS.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    assert 0 <= start < end, f"docs/parity.md must hold the table between {BEGIN!r} and {END!r}"
    current = text[start : end + len(END)]
    expected = render_table()
    assert current == expected, f"docs/parity.md's table is not CELLS and DEFECTS; replace it with:\n\n{expected}"
