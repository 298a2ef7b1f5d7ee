"""The real traces in ../shared/traces load with the right rows and medians."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from blocktune.traces.loaders import load_trace

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE_CONV = SHARED_TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
SHAREGPT = SHARED_TRACES / "sharegpt_lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

pytestmark = pytest.mark.skipif(
    not SHARED_TRACES.is_dir(), reason="../shared/traces is not present in this checkout"
)


def test_azure_conversation_trace_rows_and_medians():
    trace = load_trace(AZURE_CONV)
    frame = trace.frame
    assert trace.format == "azure"
    assert trace.rows_read == len(frame) == 19_366
    assert trace.skipped == {} and trace.warnings == []
    assert frame.prompt_tokens.median() == 1020
    assert frame.output_tokens.median() == 129
    assert frame.arrival_s.iloc[0] == 0.0 and frame.arrival_s.is_monotonic_increasing
    # One hour of traffic, and the times agree with pandas' own parse of the column.
    stamps = pd.to_datetime(pd.read_csv(AZURE_CONV, usecols=["TIMESTAMP"]).TIMESTAMP)
    expected = (stamps - stamps.min()).dt.total_seconds().to_numpy()
    np.testing.assert_allclose(frame.arrival_s, np.sort(expected), rtol=0, atol=1e-6)
    assert 3400 < frame.arrival_s.iloc[-1] < 3600


def test_azure_trace_streams_in_small_chunks_to_the_same_table():
    whole = load_trace(AZURE_CONV, "azure")
    chunked = load_trace(AZURE_CONV, "azure", chunksize=4096)
    pd.testing.assert_frame_equal(whole.frame, chunked.frame)


def test_sharegpt_lengths_load_with_a_rate():
    plain = pd.read_csv(SHAREGPT)
    trace = load_trace(SHAREGPT, "lengths", rate=8.0, seed=3)
    frame = trace.frame
    assert trace.rows_read == len(plain)
    assert len(frame) + sum(trace.skipped.values()) == len(plain)
    valid = (plain.num_prefill_tokens >= 1) & (plain.num_decode_tokens >= 1)
    assert len(frame) == int(valid.sum())
    assert frame.prompt_tokens.tolist() == plain.num_prefill_tokens[valid].tolist()
    assert frame.output_tokens.median() == plain.num_decode_tokens[valid].median()
    gaps = np.diff(frame.arrival_s)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
