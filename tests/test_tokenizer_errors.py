"""A tokenizer that is there but cannot be read is reported as such: the file and the parser's reason."""

from __future__ import annotations

import pytest

from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import load_tokenizer


def test_missing_tokenizer_says_so(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(UserError, match="has no tokenizer .*pass --prompt-ids"):
        load_tokenizer(tmp_path, "pass --prompt-ids")


@pytest.mark.parametrize("text", ['{"version": "1.0", "model": ', "not json at all"])
def test_corrupt_tokenizer_json_names_the_file_and_the_reason(tmp_path, text):
    (tmp_path / "tokenizer.json").write_text(text)
    for needed_for in (None, "pass --prompt-ids"):
        with pytest.raises(UserError) as err:
            load_tokenizer(tmp_path, needed_for)
        message = str(err.value)
        assert message.startswith(f"{tmp_path / 'tokenizer.json'}: the tokenizer cannot be read (not valid JSON: ")
        assert "has no tokenizer" not in message and "\n" not in message
