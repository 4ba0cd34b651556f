"""Identity key files (``swarm.identity``) and pinned coordinator keys (``swarm.trust``)."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from protocols.errors import ConfigError, CoordinatorKeyMismatch, IdentityError
from protocols.keys import SigningKey
from swarm.identity import create_identity, load_identity, load_or_create_identity
from swarm.trust import KnownCoordinators

pytestmark = pytest.mark.timeout(60)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# identity


def test_first_run_creates_a_private_key_file_and_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".swarm" / "identity.key"
    key = load_or_create_identity(path)
    assert path.is_file()
    assert _mode(path) == 0o600
    assert _mode(path.parent) & 0o077 == 0
    assert path.read_bytes() == key.to_libp2p_bytes()


def test_reloading_gives_the_same_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    created = load_or_create_identity(path)
    content = path.read_bytes()
    again = load_or_create_identity(path)
    assert again.peer_id == created.peer_id
    assert load_identity(path).peer_id == created.peer_id
    assert path.read_bytes() == content
    created.public_key.verify(again.sign(b"same key"), b"same key")


def test_identity_path_expands_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    key = load_or_create_identity("~/.swarm/identity.key")
    assert (tmp_path / ".swarm" / "identity.key").read_bytes() == key.to_libp2p_bytes()


@pytest.mark.parametrize(
    "content",
    [b"", b"not a key at all\n", SigningKey.generate().to_libp2p_bytes()[:-1]],
    ids=["empty", "text", "truncated"],
)
def test_corrupt_identity_names_the_path_and_says_to_move_it_away(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(path)
    message = str(info.value)
    assert str(path) in message
    assert "corrupt" in message and "move it away" in message
    assert path.read_bytes() == content


def test_identity_whose_halves_do_not_match_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(SigningKey.generate().to_libp2p_bytes()[:36] + SigningKey.generate().public_key.raw)
    with pytest.raises(IdentityError, match="public half does not match") as info:
        load_identity(path)
    assert str(path) in str(info.value)


def test_identity_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.mkdir()
    with pytest.raises(IdentityError, match="cannot read identity") as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)


def test_identity_under_a_file_is_refused_without_claiming_it_exists(tmp_path: Path) -> None:
    # ~/.swarm is a plain file: there is no identity yet, so "already exists" would send the user astray.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    path = blocker / "identity.key"
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(path)
    assert str(blocker) in str(info.value)
    assert "already exists" not in str(info.value)
    assert blocker.read_text() == "x"


def test_create_identity_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    original = create_identity(path)
    content = path.read_bytes()
    with pytest.raises(IdentityError, match="already exists") as info:
        create_identity(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == content
    assert load_identity(path).peer_id == original.peer_id


def test_readable_identity_warns_with_the_fix(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "identity.key"
    create_identity(path)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="swarm.identity"):
        load_identity(path)
    assert f"chmod 600 {path}" in caplog.text


# pinned coordinator keys


def test_pin_then_pinned_round_trips_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "state" / "known_coordinators.json"
    first, second = SigningKey.generate().public_key, SigningKey.generate().public_key
    known = KnownCoordinators(path)
    assert known.pinned("run-a") is None
    known.pin("run-a", first)
    known.pin("run-b", second)
    reopened = KnownCoordinators(path)
    assert reopened.pinned("run-a") == first
    assert reopened.pinned("run-b") == second
    assert reopened.pinned("run-c") is None
    assert json.loads(path.read_text()) == {"run-a": first.peer_id, "run-b": second.peer_id}
    assert not list(path.parent.glob("*.tmp")), "no temporary file is left"


def test_peers_that_pin_at_once_under_one_home_all_succeed_and_leave_a_whole_file(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "known_coordinators.json"
    keys = [SigningKey.generate().public_key for _ in range(8)]
    errors: list[BaseException] = []

    def pin(index: int) -> None:
        try:
            for _ in range(20):
                KnownCoordinators(path).pin(f"run-{index}", keys[index])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=pin, args=(i,)) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []  # a shared temporary name made concurrent pins fail with FileNotFoundError
    # Without the lock, two pins read the same file and the later write dropped the other's run.
    assert json.loads(path.read_text()) == {f"run-{i}": k.peer_id for i, k in enumerate(keys)}


def test_pinning_the_same_key_again_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "known_coordinators.json"
    key = SigningKey.generate().public_key
    known = KnownCoordinators(path)
    known.pin("run", key)
    path.write_text(path.read_text() + "\n")
    known.pin("run", key)
    assert path.read_text().endswith("}\n")
    assert known.pinned("run") == key


@pytest.mark.parametrize(
    "content", ["{not json", "", '["a", "b"]', '{"run": 3}'], ids=["syntax", "empty", "list", "non-str"]
)
def test_corrupt_pin_file_is_a_config_error_naming_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "known_coordinators.json"
    path.write_text(content)
    known = KnownCoordinators(path)
    with pytest.raises(ConfigError) as info:
        known.pinned("run")
    assert str(path) in str(info.value)
    assert "fix or remove" in str(info.value)
    with pytest.raises(ConfigError):
        known.pin("run", SigningKey.generate().public_key)
    assert path.read_text() == content


def test_pinned_entry_that_is_not_a_peer_id_names_the_run(tmp_path: Path) -> None:
    path = tmp_path / "known_coordinators.json"
    path.write_text(json.dumps({"good-run": SigningKey.generate().peer_id, "bad-run": "not-a-peer-id"}))
    known = KnownCoordinators(path)
    assert known.pinned("good-run") is not None
    with pytest.raises(ConfigError) as info:
        known.pinned("bad-run")
    assert "'bad-run'" in str(info.value)
    assert str(path) in str(info.value)


def test_a_pin_never_overwrites_another_coordinators_key_unless_the_user_named_it(tmp_path: Path) -> None:
    path = tmp_path / "known_coordinators.json"
    first, second = SigningKey.generate().public_key, SigningKey.generate().public_key
    KnownCoordinators(path).pin("run-a", first)
    # Another peer under the same HOME, which read the file before the first pin, trusted another key.
    with pytest.raises(CoordinatorKeyMismatch, match=first.peer_id):
        KnownCoordinators(path).pin("run-a", second)
    assert KnownCoordinators(path).pinned("run-a") == first
    KnownCoordinators(path).pin("run-a", second, replace=True)  # --coordinator-key names it
    assert KnownCoordinators(path).pinned("run-a") == second
