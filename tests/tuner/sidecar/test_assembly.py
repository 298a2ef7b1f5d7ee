"""A sidecar built from its policy: one table row per actuator kind and per polled source,
the parts it is given, and the stats record it hands out."""

from pathlib import Path
from typing import get_args

import pytest

from blocktune.tuner.config.policy import (
    ActuatorSettings,
    JsonlLogSettings,
    Sources,
    VllmMetricsSettings,
    load_policy,
)
from blocktune.tuner.sidecar.actuators import HttpActuator
from blocktune.tuner.sidecar.assembly import ACTUATORS, SOURCES, build_sidecar
from blocktune.tuner.sidecar.command_actuator import CommandActuator
from blocktune.tuner.sidecar.jsonl_log import JsonlLogFollower
from blocktune.tuner.sidecar.vllm_metrics import VllmMetricsSource

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")


def test_every_actuator_kind_and_polled_source_of_the_policy_has_a_row():
    kinds = get_args(ActuatorSettings.model_fields["kind"].annotation)
    assert set(ACTUATORS) == set(kinds) - {"none"}
    assert set(SOURCES) == set(Sources.model_fields) - {"push"}


@pytest.mark.parametrize(
    ("settings", "made", "target"),
    [
        (
            ActuatorSettings(kind="http", url="http://127.0.0.1:9"),
            HttpActuator,
            "http://127.0.0.1:9/admin/block-size",
        ),
        (
            ActuatorSettings(kind="command", command=["./restart.sh", "{block_size}"]),
            CommandActuator,
            "command ./restart.sh",
        ),
    ],
)
def test_the_actuator_is_made_by_the_row_of_its_kind(settings, made, target):
    sidecar = build_sidecar(POLICY.model_copy(update={"actuator": settings, "mode": "enforce"}))
    assert type(sidecar.actuator) is made and sidecar.actuator.target == target
    assert sidecar.enforcing
    assert sidecar.stats().swaps == {"done": 0, "rejected": 0, "rolled_back": 0, "failed": 0}
    sidecar.actuator.close()


def test_without_an_actuator_there_is_none_and_no_swap_count():
    sidecar = build_sidecar(POLICY)
    assert sidecar.actuator is None and not sidecar.enforcing
    assert sidecar.stats().swaps is None


def test_a_source_for_each_field_set_its_relative_path_from_the_policy_folder(tmp_path):
    sources = Sources(
        push=False,
        vllm_metrics=VllmMetricsSettings(url="http://127.0.0.1:9/metrics"),
        jsonl_log=JsonlLogSettings(path="logs/requests.jsonl"),
    )
    sidecar = build_sidecar(POLICY.model_copy(update={"sources": sources}), base_dir=tmp_path)
    assert [type(s) for s in sidecar.sources] == [VllmMetricsSource, JsonlLogFollower]
    assert sidecar.sources[1].path == tmp_path / "logs" / "requests.jsonl"
    assert list(sidecar.statuses) == ["vllm_metrics", "jsonl_log"]
    for source in sidecar.sources:
        source.close()


def test_a_scraped_block_size_reaches_the_sidecar_built_after_its_source():
    sources = Sources(vllm_metrics=VllmMetricsSettings(url="http://127.0.0.1:9/metrics"))
    sidecar = build_sidecar(POLICY.model_copy(update={"sources": sources}))
    sidecar.sources[0].ingest('vllm:cache_config_info{block_size="32"} 1.0\n')
    assert sidecar.current_block_size == 32 and sidecar.stats().current_block_size == 32
    sidecar.sources[0].close()


def test_the_stats_are_a_copy_that_shares_nothing_with_the_sidecar():
    sidecar = build_sidecar(POLICY)
    sidecar.push([{"prompt_tokens": 20, "output_tokens": 10}] * 3)
    first = sidecar.stats()
    first.decisions["true"] = 99
    first.engine_mismatches["device"] = 7
    first.restarts_s.append(1.0)
    again = sidecar.stats()
    assert again.observations == 3 and again.window_requests == 3
    assert again.decisions == {"true": 0, "false": 0}
    assert again.engine_mismatches == {"block_size": 0, "backend": 0, "device": 0}
    assert not again.restarts_s
    assert again.source_errors == {"push": 0} and again.padding_ratio == {}
