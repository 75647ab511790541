"""torchacc.memory_report on every rank of FSDP and DP (2 ranks) and HSDP (4 ranks).

The ranks run tests/multiproc/report_scenarios.py inside the launches of the ``two_ranks`` and
``four_ranks`` fixtures (conftest.py), which test_parity.py shares. The model is TinyNet(dim=16,
3 blocks, units: the blocks and the root), float32; the counts below are worked out from its shapes.
Shard(0) splits a dim of n rows like ``torch.chunk(n, 2)``: ceil(n/2) rows on rank 0, the rest on rank 1.

- per block: fc1 weight (64, 16) and bias (64,), fc2 weight (16, 64) and bias (16,): 2128 elements, of
  which each rank holds 32*16 + 32 + 8*64 + 8 = 1064;
- head weight (1, 16) and bias (1,): one row, so rank 0 holds all 17 elements and rank 1 none;
- full: 3 * 2128 + 17 = 6401 elements (25604 bytes); rank 0: 3 * 1064 + 17 = 3209, rank 1: 3192;
- AdamW after one step: exp_avg and exp_avg_sq sharded like the parameters, plus one 0-dim float32 step
  per parameter (14), held whole by every rank: full 2 * 6401 + 14 = 12816, rank 0 6432, rank 1 6398.
"""

from torchacc.parallel.memory_report import Footprint

FULL_PARAMS = (6401, 25604)
FULL_STATE = (12816, 51264)
HELD_PARAMS = {0: (3209, 12836), 1: (3192, 12768)}  # by the rank's index on the fsdp axis
HELD_STATE = {0: (6432, 25728), 1: (6398, 25592)}
NOTHING = Footprint(0, 0, 0, 0)


def sharded(shard: int) -> tuple[Footprint, Footprint]:
    """(parameters or gradients, optimizer state) of the rank at index ``shard`` of a 2-way fsdp axis."""
    return Footprint(*HELD_PARAMS[shard], *FULL_PARAMS), Footprint(*HELD_STATE[shard], *FULL_STATE)


def assert_reports(result: dict, *, params: Footprint, state: Footprint) -> None:
    """The three moments of report_scenarios.reports(): before training, after one step, after zero_grad."""
    plain, stepped, zeroed = result["plain"], result["stepped"], result["zeroed"]
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (params, NOTHING, NOTHING)
    assert (stepped.parameters, stepped.gradients, stepped.optimizer_state) == (params, params, state)
    assert result["stepped_model_only"].optimizer_state == NOTHING
    assert (zeroed.parameters, zeroed.gradients, zeroed.optimizer_state) == (params, NOTHING, state)
    assert stepped.total == params + params + state
    assert stepped.reduction == (2 * params.full_bytes + state.full_bytes) / (2 * params.held_bytes + state.held_bytes)


def test_fsdp_two_ranks_with_an_uneven_shard(two_ranks):
    for rank, rank_result in enumerate(two_ranks):
        result = rank_result["memory_report"]["fsdp"]
        params, state = sharded(rank)
        assert_reports(result, params=params, state=state)
        report = result["stepped"]
        assert (report.num_units, report.mesh_shape, report.mesh_dim_names) == (4, (2,), ("fsdp",))
        assert (report.rank, report.world_size) == (rank, 2)
    assert two_ranks[0]["memory_report"]["fsdp"]["stepped"].total == Footprint(12850, 51400, 25618, 102472)
    assert two_ranks[1]["memory_report"]["fsdp"]["stepped"].total == Footprint(12782, 51128, 25618, 102472)


def test_fsdp_table_and_log_line(two_ranks):
    assert str(two_ranks[0]["memory_report"]["fsdp"]["stepped"]) == (
        "rank 0 of 2, FSDP mesh (fsdp=2), 4 units\n"
        "                 held on this rank  full model  reduction\n"
        "parameters                12.5 KiB    25.0 KiB      1.99x\n"  # 12836 B of 25604 B
        "gradients                 12.5 KiB    25.0 KiB      1.99x\n"
        "optimizer state           25.1 KiB    50.1 KiB      1.99x\n"  # 25728 B of 51264 B
        "total                     50.2 KiB   100.1 KiB      1.99x"  # 51400 B of 102472 B
    )
    rank_1 = str(two_ranks[1]["memory_report"]["fsdp"]["plain"])
    assert "parameters                12.5 KiB    25.0 KiB      2.01x" in rank_1  # 12768 B of 25604 B
    assert two_ranks[0]["memory_report"]["fsdp"]["log"] == [
        "torchacc: FSDP over 2 ranks (fsdp=2), 4 units; parameters 12.5 KiB of 25.0 KiB per rank (1.99x less)"
    ]
    assert two_ranks[1]["memory_report"]["fsdp"]["log"] == [], "only rank 0 logs"


def test_dp_two_ranks_holds_everything(two_ranks):
    for rank, rank_result in enumerate(two_ranks):
        result = rank_result["memory_report"]["dp"]
        assert_reports(result, params=Footprint(*FULL_PARAMS, *FULL_PARAMS), state=Footprint(*FULL_STATE, *FULL_STATE))
        report = result["stepped"]
        assert (report.num_units, report.mesh_shape, report.mesh_dim_names, report.reduction) == (0, None, None, 1.0)
        assert (report.rank, report.world_size) == (rank, 2)
        assert str(report).startswith(f"rank {rank} of 2, DP (no mesh), 0 units\n")
    assert two_ranks[0]["memory_report"]["dp"]["log"] == [
        "torchacc: DP over 2 ranks, nothing sharded; parameters 25.0 KiB per rank"
    ]


def test_hsdp_four_ranks_holds_the_share_of_its_fsdp_index(four_ranks):
    for rank, rank_result in enumerate(four_ranks):
        result = rank_result["memory_report"]["hsdp"]
        params, state = sharded(rank % 2)  # mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold the head
        assert_reports(result, params=params, state=state)
        report = result["stepped"]
        assert (report.num_units, report.mesh_shape, report.mesh_dim_names) == (4, (2, 2), ("dp", "fsdp"))
        assert (report.rank, report.world_size) == (rank, 4)
        assert str(report).startswith(f"rank {rank} of 4, HSDP mesh (dp=2, fsdp=2), 4 units\n")
    assert four_ranks[0]["memory_report"]["hsdp"]["log"] == [
        "torchacc: HSDP over 4 ranks (dp=2, fsdp=2), 4 units; parameters 12.5 KiB of 25.0 KiB per rank (1.99x less)"
    ]
    assert all(r["memory_report"]["hsdp"]["log"] == [] for r in four_ranks[1:])
