"""The request bodies' strict models: what they refuse, and that their JSON schema says so."""

import jsonschema
import pytest
from pydantic import ValidationError

from blocktune.tuner.serving.openai_protocol import CompletionRequest


@pytest.mark.parametrize("key", ["05", "\u0665", "+5", " 5", "5 ", "5.0", "-1", "", "1_0"])
def test_a_logit_bias_key_is_a_plain_decimal_token_id(key):
    """Only "5" is token 5: not "05", nor an Arabic-Indic digit, which int() would read."""
    with pytest.raises(ValidationError, match="logit_bias") as refused:
        CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {key: 1.0}}, strict=True)
    assert repr(key) in str(refused.value)
    assert not _schema_takes(CompletionRequest, {"prompt": "hi", "logit_bias": {key: 1.0}})


@pytest.mark.parametrize("key", ["0", "5", "49151"])
def test_canonical_token_ids_are_taken(key):
    body = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {key: -1.0}})
    assert body.token_bias() == {int(key): -1.0}
    assert _schema_takes(CompletionRequest, {"prompt": "hi", "logit_bias": {key: -1.0}})


def _schema_takes(model, body: dict) -> bool:
    """Whether `body` satisfies `model`'s JSON schema."""
    try:
        jsonschema.validate(body, model.model_json_schema())
    except jsonschema.ValidationError:
        return False
    return True
