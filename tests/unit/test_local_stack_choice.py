"""Choosing the local stack's AWS emulator: a wrong name is a clear error naming
where it came from and what is allowed; a stream retention only where the emulator
can trim (ministack)."""
from __future__ import annotations

import pytest

from ddb2bt.pipeline.local.local_stack import (DEFAULT_DYNAMODB, DYNAMODB_ENV, MINISTACK, MOTO, LocalStack,
                                               StackError, default_dynamodb)


def test_the_default_and_the_variable(monkeypatch):
    monkeypatch.delenv(DYNAMODB_ENV, raising=False)
    assert default_dynamodb() == DEFAULT_DYNAMODB == MINISTACK
    assert LocalStack().dynamodb == MINISTACK
    monkeypatch.setenv(DYNAMODB_ENV, MOTO)
    assert LocalStack().dynamodb == MOTO


def test_a_wrong_name_says_where_it_came_from_and_what_is_allowed(monkeypatch):
    monkeypatch.setenv(DYNAMODB_ENV, "localstack")
    with pytest.raises(StackError) as err:
        default_dynamodb()
    assert DYNAMODB_ENV in str(err.value) and "'localstack'" in str(err.value)
    assert "moto, ministack" in str(err.value)
    with pytest.raises(StackError, match="moto, ministack"):
        LocalStack(dynamodb="dynalite")


def test_only_ministack_takes_a_stream_retention():
    with pytest.raises(StackError, match="moto never trims"):
        LocalStack(dynamodb=MOTO, stream_retention_s=5)
    assert LocalStack(dynamodb=MINISTACK, stream_retention_s=5).stream_retention_s == 5
