"""The scheduler without a model: chunks within the step budget, preemption, a new block pair."""

from blocktune.runtime.block_manager import BlockManager
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.requests import Request
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.scheduler import Scheduler


def _scheduler(num_blocks=16, **config):
    config = EngineConfig(
        **{"block_size": 8, "num_blocks": num_blocks, "max_model_len": 64, "max_num_seqs": 2}
        | {"candidate_block_sizes": (8, 16)}
        | config
    )
    return Scheduler(config, num_blocks * config.block_size, "cpu")


def _request(request_id, prompt_tokens):
    return Request(request_id, list(range(1, prompt_tokens + 1)), SamplingParams(), 0.0, None)


def _chunks(batch):
    return [(c.request.id, c.start, c.end, c.last) for c in batch.prefills]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget():
    scheduler = _scheduler(max_num_batched_tokens=8)
    request = _request(0, 20)
    scheduler.add(request)
    batches = [scheduler.schedule() for _ in range(3)]
    assert [_chunks(b) for b in batches] == [
        [(0, 0, 8, False)],
        [(0, 8, 16, False)],
        [(0, 16, 20, True)],
    ]
    assert [b.sampled for b in batches] == [[], [], [request]]
    assert scheduler.stats()["blocks_used"] == 3  # the whole prompt's blocks at admission
    request.output.append(7)  # the token the last chunk sampled
    batch = scheduler.schedule()
    assert batch.decodes == [request] and batch.prefills == [] and batch.sampled == [request]
    assert scheduler.blocks.num_tokens(0) == 21


def test_decodes_take_their_tokens_of_the_budget_before_prefills():
    scheduler = _scheduler(max_num_batched_tokens=8)
    short, long = _request(0, 4), _request(1, 20)
    scheduler.add(short)
    scheduler.add(long)
    first = scheduler.schedule()
    assert _chunks(first) == [(0, 0, 4, True), (1, 0, 4, False)]
    assert first.sampled == [short]
    short.output.append(3)
    second = scheduler.schedule()
    assert second.decodes == [short]
    assert _chunks(second) == [(1, 4, 11, False)]  # 8 tokens less the decode's one
    assert second.sampled == [short]


def test_growth_preempts_the_youngest_which_waits_first_to_be_recomputed():
    scheduler = _scheduler(num_blocks=4)
    older, younger = _request(0, 16), _request(1, 16)
    scheduler.add(older)
    scheduler.add(younger)
    assert _chunks(scheduler.schedule()) == [(0, 0, 16, True), (1, 0, 16, True)]
    older.output.append(5)
    younger.output.append(6)
    batch = scheduler.schedule()  # the older one's 17th token needs the younger one's block
    assert batch.decodes == [older] and batch.prefills == []
    assert scheduler.preemptions == 1 and younger.row is None
    assert scheduler.running == (older,)
    assert scheduler.stats()["waiting"] == 1
    assert scheduler.remove(0) is older and scheduler.remove(0) is None
    readmitted = scheduler.schedule()
    assert _chunks(readmitted) == [(1, 0, 17, True)]  # its prompt and its sampled token
    assert scheduler.unfinished == (younger,)


def test_an_installed_pair_serves_the_next_admissions_at_its_block_size():
    scheduler = _scheduler()
    config = scheduler.config
    scheduler.install(
        BlockManager(8, 16, align=scheduler.align(16)),
        BlockTable(config.max_num_seqs, 4, 16),
    )
    scheduler.add(_request(0, 20))
    scheduler.schedule()
    stats = scheduler.stats()
    assert (stats["block_size"], stats["blocks_total"], stats["blocks_used"]) == (16, 8, 2)
    assert stats["padding_slots"] == 32 - 20
    assert scheduler.table.row(0) == scheduler.blocks.block_ids(0)
