"""--model-shape: a random Llama's shape, read from `hidden=H,layers=L,heads=N[,kv_heads=K]`."""

import argparse

import pytest

from blocktune.tuner.cli.model_args import add_model_arguments


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_model_arguments(parser)
    return parser


def test_a_shape_reads_its_integers_and_kv_heads_defaults_to_heads():
    parse = _parser().parse_args
    given = parse(["--model-shape", "hidden=256,layers=4,heads=8,kv_heads=2"]).model_shape
    assert given == {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2}
    assert parse(["--model-shape", "hidden=64, layers=2, heads=4"]).model_shape["kv_heads"] == 4
    assert parse([]).model_shape is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hidden=256,layers=4", "lacks heads"),
        ("hidden=256,layers=4,heads=8,depth=2", "got 'depth=2'"),
        ("hidden=256,layers=x,heads=8", "got 'layers=x'"),
        ("hidden=100,layers=4,heads=8", "positive multiple of heads"),
        ("hidden=256,layers=0,heads=8", "positive multiple of heads"),
    ],
)
def test_a_bad_shape_is_refused_with_what_is_wrong(text, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(["--model-shape", text])
