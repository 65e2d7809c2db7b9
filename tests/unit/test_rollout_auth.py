"""The rollout servers' token and request checks as pure functions (the servers themselves are
tested with hostile clients in tests/integration/test_rollout_security.py)."""

import os
import stat

import pytest

from plait.rollout.api import ApiError, JoinRequest, Limits, UpdateRequest, check_join, check_update
from plait.rollout.auth import ENV, TokenError, bearer, resolve_token, token_matches


def test_the_first_side_creates_a_private_token_file_and_the_other_reads_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    token, source = resolve_token()
    path = tmp_path / "plait" / "rollout-token"
    assert source == str(path) and len(token) >= 40
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert resolve_token() == (token, source)  # the other side: same token
    assert resolve_token(tmp_path / "other")[0] != token  # another file, another token
    monkeypatch.setenv(ENV, "from-the-environment")
    assert resolve_token() == ("from-the-environment", f"${ENV}")
    monkeypatch.delenv(ENV)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        resolve_token(tmp_path / "empty")


def test_only_the_exact_bearer_header_matches():
    assert token_matches(bearer("abc")["Authorization"], "abc")
    assert token_matches(b"Bearer abc", "abc")
    for bad in (None, "", "abc", "Bearer abcd", "Bearer ab", "bearer abc", "Basic abc", "Bearer abc "):
        assert not token_matches(bad, "abc"), bad


def test_a_join_names_only_the_caller_or_an_allowed_address():
    req = JoinRequest(host="10.0.0.5", port=29500, rank_offset=1, world=2, backend="gloo", timeout_s=60)
    assert check_join(req, "10.0.0.5", Limits(), 1) == "10.0.0.5"
    with pytest.raises(ApiError) as e:
        check_join(req, "10.0.0.9", Limits(), 1)
    assert e.value.status == 403 and "--weights-from 10.0.0.5" in e.value.message
    assert check_join(req, "10.0.0.9", Limits(join_from=("10.0.0.5",)), 1) == "10.0.0.5"
    with pytest.raises(ApiError) as e:
        check_join(req, "10.0.0.5", Limits(), 2)  # 2 workers don't fit a world of 2 from rank 1
    assert e.value.status == 400


@pytest.mark.parametrize(
    "metas, buckets, why",
    [
        ([["w", "load", [2]]], [[0]], "dtype"),
        ([["w", "float32", [-1]]], [[0]], "dtype"),
        ([["w", "float32", [2]], ["v", "float32", [2]]], [[0]], "exactly once"),
        ([["w", "float32", [2]]], [[0, 0]], "exactly once"),
        ([["w", "float32", [2]], ["v", "bfloat16", [2]]], [[0, 1]], "one dtype"),
    ],
)
def test_weight_updates_must_come_from_the_joiner_and_be_well_formed(metas, buckets, why):
    good = UpdateRequest(version=1, metas=[["w", "float32", [2]]], buckets=[[0]])
    check_update(good, "10.0.0.5", joined_by="10.0.0.5")
    with pytest.raises(ApiError) as e:
        check_update(good, "10.0.0.5", joined_by=None)
    assert e.value.status == 409
    with pytest.raises(ApiError) as e:
        check_update(good, "10.0.0.6", joined_by="10.0.0.5")
    assert e.value.status == 403
    with pytest.raises(ApiError) as e:
        check_update(UpdateRequest(version=1, metas=metas, buckets=buckets), "10.0.0.5", joined_by="10.0.0.5")
    assert e.value.status == 400 and why in e.value.message
