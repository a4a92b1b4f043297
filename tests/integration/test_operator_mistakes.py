"""Operator mistakes that used to lose a cluster or open it up, each refused or reported in one line.

The catalog key (one key per catalog, fingerprinted in it), the catalog key's name (no clash with the
client's KVGW_SECRET_KEY), a changed root secret, unknown or malformed settings, and --anonymous.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet

from gateway.cli import main as kvgw
from gateway.config import ConfigurationError, load_settings, report_unknown_variables
from gateway.runtime import open_catalog
from tests.conftest import ROOT_AK, ROOT_SK, ServerProcess

SETTING_VARIABLES = ("KVGW_CATALOG_URL", "KVGW_CATALOG_KEY", "KVGW_CATALOG_KEY_FILE", "KVGW_SECRET_KEY",
                     "KVGW_SECRET_KEY_FILE", "KVGW_ROOT_ACCESS_KEY", "KVGW_ROOT_SECRET_KEY", "KVGW_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SETTING_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = kvgw(list(args))
    return code, out.getvalue(), err.getvalue()


# -- 12: never a second key for a catalog that holds secrets -------------------------------------


def test_cred_create_elsewhere_against_a_shared_catalog_is_refused(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGW_CATALOG_URL", pg_url)
    gateway_dir, elsewhere = tmp_path / "gateway", tmp_path / "elsewhere"
    gateway_dir.mkdir()  # the gateway's data dir; `elsewhere` is none (only `kvgw serve` creates one)
    code, out, _ = run("cred", "create", "--root", "--data-dir", str(gateway_dir))
    assert code == 0
    first = json.loads(out)
    # the mistake: the same catalog from a directory without the key file
    code, out, err = run("cred", "create", "--root", "--data-dir", str(elsewhere))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "holds credentials encrypted with key" in err and "KVGW_CATALOG_KEY" in err
    assert not (elsewhere / "secret.key").exists()  # no new key was created
    # a wrong key given explicitly is refused the same way, naming both fingerprints
    monkeypatch.setenv("KVGW_CATALOG_KEY", Fernet.generate_key().decode())
    code, _, err = run("cred", "create", "--data-dir", str(elsewhere))
    assert code == 2 and "is encrypted with key" in err and "not with this key" in err
    # the right key works, and the catalog still reads the first credential
    monkeypatch.setenv("KVGW_CATALOG_KEY", (gateway_dir / "secret.key").read_text())
    code, out, _ = run("cred", "list", "--data-dir", str(elsewhere))
    assert code == 0 and first["access_key"] in out and first["secret_key"] not in out


def test_a_catalog_from_before_fingerprints_is_checked_by_decrypting(tmp_path: Path) -> None:
    """Catalogs written before the fingerprint existed: the key is proven on a stored secret."""
    settings = load_settings(data_dir=tmp_path / "d")
    catalog = open_catalog(settings)
    catalog.create_credential(description="old")
    with catalog.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM catalog_meta")
    catalog.close()
    (tmp_path / "d" / "secret.key").write_bytes(Fernet.generate_key())
    with pytest.raises(ConfigurationError, match="is encrypted with key \\(unrecorded\\)"):
        open_catalog(settings)


def test_a_gateway_with_another_key_fails_at_start_in_one_line(
    pg_url: str, server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    first = server_factory(data_dir=tmp_path / "a", env={"KVGW_CATALOG_URL": pg_url}).start()
    first.stop()
    second = server_factory(data_dir=tmp_path / "b", env={"KVGW_CATALOG_URL": pg_url})
    with pytest.raises(RuntimeError, match="exited") as info:
        second.start()
    log = str(info.value)
    assert "holds credentials encrypted with key" in log and "Traceback" not in log


# -- 13: the catalog key has its own name; KVGW_SECRET_KEY is the client's ------------------------


def test_client_secret_in_kvgw_secret_key_does_not_break_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGW_SECRET_KEY", "a-users-secret-for-the-client")  # not a Fernet key
    catalog = open_catalog(load_settings(data_dir=tmp_path / "d"))
    assert catalog.box.fingerprint == catalog.key_fingerprint()
    catalog.close()
    assert (tmp_path / "d" / "secret.key").exists()  # the key file, not the client's secret


def test_old_name_still_works_for_a_fernet_key_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key = Fernet.generate_key().decode()
    monkeypatch.setenv("KVGW_SECRET_KEY", key)
    with caplog.at_level(logging.WARNING, logger="kvgw.config"):
        catalog = open_catalog(load_settings(data_dir=tmp_path / "d"))
    assert "KVGW_SECRET_KEY as the catalog key is deprecated" in caplog.text
    fingerprint = catalog.key_fingerprint()
    catalog.close()
    monkeypatch.delenv("KVGW_SECRET_KEY")
    monkeypatch.setenv("KVGW_CATALOG_KEY", key)
    catalog = open_catalog(load_settings(data_dir=tmp_path / "d"))
    assert catalog.key_fingerprint() == fingerprint
    catalog.close()
    assert not (tmp_path / "d" / "secret.key").exists()


def test_a_catalog_key_that_is_no_fernet_key_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGW_CATALOG_KEY", "not-a-key")
    with pytest.raises(ConfigurationError, match=r"not a Fernet key.*Fernet\.generate_key"):
        open_catalog(load_settings(data_dir=tmp_path / "d"))


# -- 14: a changed root secret is refused, and rotation is a command -----------------------------


def test_changed_root_secret_refuses_start_and_rotate_applies_it(
    server_factory: type[ServerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    server = server_factory(data_dir=data).start()
    server.stop()
    changed = server_factory(data_dir=data, env={"KVGW_ROOT_SECRET_KEY": "a-new-root-secret-0123456789"})
    with pytest.raises(RuntimeError, match="exited") as info:
        changed.start()
    assert f"kvgw cred rotate {ROOT_AK}" in str(info.value) and "Traceback" not in str(info.value)

    code, out, _ = run("cred", "rotate", ROOT_AK, "--secret-key", "a-new-root-secret-0123456789",
                       "--data-dir", str(data))
    assert code == 0 and json.loads(out)["secret_key"] == "a-new-root-secret-0123456789"
    server = server_factory(data_dir=data, env={"KVGW_ROOT_SECRET_KEY": "a-new-root-secret-0123456789"}).start()
    new_auth = {"Authorization": f"Bearer {ROOT_AK}:a-new-root-secret-0123456789"}
    assert httpx.get(f"{server.url}/v1/admin/stats", headers=new_auth).status_code == 200
    assert httpx.get(f"{server.url}/v1/admin/stats", headers=server.auth).status_code == 401
    assert ROOT_SK not in json.dumps(run("cred", "list", "--data-dir", str(data))[1])


def test_cred_delete_and_unknown_credentials(tmp_path: Path) -> None:
    code, out, _ = run("cred", "create", "--data-dir", str(tmp_path))
    assert code == 0
    access_key = json.loads(out)["access_key"]
    assert run("cred", "delete", access_key, "--data-dir", str(tmp_path))[0] == 0
    assert access_key not in run("cred", "list", "--data-dir", str(tmp_path))[1]
    assert run("cred", "delete", access_key, "--data-dir", str(tmp_path))[0] == 1
    assert run("cred", "rotate", access_key, "--data-dir", str(tmp_path))[0] == 1


# -- 15: unknown variables and bad values get one line each; common URL forms work ----------------


def test_unknown_variables_are_named_with_a_guess() -> None:
    lines = report_unknown_variables({"KVGW_CATALOG_URI": "x", "KVGW_S3__ENDPOINT": "y", "KVGW_PORT": "1",
                                      "KVGW_TEST_S3_ENDPOINT": "z", "KVGW_ACCESS_KEY": "client", "PATH": "/"})
    assert lines == ["unknown setting KVGW_CATALOG_URI ignored (did you mean KVGW_CATALOG_URL?)",
                     "unknown setting KVGW_S3__ENDPOINT ignored (did you mean KVGW_S3__ENDPOINT_URL?)"]


def test_bad_values_are_one_line_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGW_PORT", "eighty")
    monkeypatch.setenv("KVGW_FSYNC", "perhaps")
    code, _, err = run("db", "upgrade", "--data-dir", str(tmp_path))
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert any("KVGW_PORT='eighty'" in line for line in lines)
    assert any("KVGW_FSYNC='perhaps'" in line for line in lines)


@pytest.mark.parametrize("scheme", ["postgres://", "postgresql://", "postgresql+psycopg://"])
def test_common_postgresql_url_forms(scheme: str, pg_url: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url = scheme + pg_url.split("://", 1)[1]
    monkeypatch.setenv("KVGW_CATALOG_URL", url)
    code, out, err = run("db", "upgrade", "--data-dir", str(tmp_path))
    assert code == 0, err
    assert "postgresql+psycopg://" in out


# -- 16: --anonymous reads and writes; deleting and administering need --anonymous-admin ----------


def test_anonymous_may_read_and_write_not_delete_or_administer(
    server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--anonymous"]).start()
    url = server.chunk_url("anon-key")
    assert httpx.put(url, content=b"x").status_code == 201
    assert httpx.get(url).content == b"x"
    assert httpx.delete(url).status_code == 401
    assert httpx.get(f"{server.url}/v1/admin/stats").status_code == 401
    assert httpx.get(url).content == b"x"
    assert httpx.delete(url, headers=server.auth).status_code == 204
    assert "WARNING: --anonymous" in server.log()


def test_anonymous_admin_is_explicit(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "d", extra_args=["--anonymous-admin"]).start()
    url = server.chunk_url("anon-key")
    assert httpx.put(url, content=b"x").status_code == 201
    assert httpx.delete(url).status_code == 204
    assert httpx.get(f"{server.url}/v1/admin/stats").status_code == 200
    assert "WARNING: --anonymous-admin" in server.log()


def test_root_secret_unchanged_keeps_working(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    """The refusal above is for a changed secret only: restarts with the same one are routine."""
    for _ in range(2):
        server = server_factory(data_dir=tmp_path / "d").start()
        assert httpx.get(f"{server.url}/v1/admin/stats",
                         headers={"Authorization": f"Bearer {ROOT_AK}:{ROOT_SK}"}).status_code == 200
        server.stop()
