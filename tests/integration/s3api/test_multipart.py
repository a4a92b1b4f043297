"""Multipart uploads: many parts, listing, abort, completion rules, write-once, invisibility until
Complete, completion on another gateway sharing the directory, and the stale-upload sweeper."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from tests.conftest import ServerProcess
from tests.integration.s3api.conftest import MIN_PART, MiB, boto3_client
from tests.integration.s3api.test_objects import error_code, status

B = "kvcache"


def _upload_parts(s3: Any, key: str, parts: list[bytes], **create: Any) -> tuple[str, list[dict[str, Any]]]:
    upload_id = s3.create_multipart_upload(Bucket=B, Key=key, **create)["UploadId"]
    done = []
    for number, data in enumerate(parts, 1):
        etag = s3.upload_part(Bucket=B, Key=key, UploadId=upload_id, PartNumber=number, Body=data)["ETag"]
        done.append({"PartNumber": number, "ETag": etag})
    return upload_id, done


def test_many_parts_round_trip(s3: Any) -> None:
    parts = [os.urandom(MIN_PART) for _ in range(11)] + [os.urandom(12345)]
    upload_id, done = _upload_parts(s3, "mp/many", parts, ContentType="application/x-test", Metadata={"a": "b"})
    with pytest.raises(ClientError):
        s3.head_object(Bucket=B, Key="mp/many")  # invisible until Complete
    assert "Contents" not in s3.list_objects_v2(Bucket=B, Prefix="mp/")
    listed = s3.list_parts(Bucket=B, Key="mp/many", UploadId=upload_id)
    assert [p["PartNumber"] for p in listed["Parts"]] == list(range(1, 13))
    assert [p["Size"] for p in listed["Parts"]] == [len(p) for p in parts]
    page = s3.list_parts(Bucket=B, Key="mp/many", UploadId=upload_id, MaxParts=5, PartNumberMarker=5)
    assert [p["PartNumber"] for p in page["Parts"]] == [6, 7, 8, 9, 10] and page["IsTruncated"]
    uploads = s3.list_multipart_uploads(Bucket=B)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("mp/many", upload_id)]
    result = s3.complete_multipart_upload(Bucket=B, Key="mp/many", UploadId=upload_id,
                                          MultipartUpload={"Parts": done})
    got = s3.get_object(Bucket=B, Key="mp/many")
    assert got["Body"].read() == b"".join(parts)
    assert got["ETag"] == result["ETag"] and got["ContentType"] == "application/x-test"
    assert got["Metadata"] == {"a": "b"}
    assert "Uploads" not in s3.list_multipart_uploads(Bucket=B)
    # a retried Complete (lost reply) answers as the first did
    again = s3.complete_multipart_upload(Bucket=B, Key="mp/many", UploadId=upload_id,
                                         MultipartUpload={"Parts": done})
    assert again["ETag"] == result["ETag"]
    with pytest.raises(ClientError) as exc:
        s3.list_parts(Bucket=B, Key="mp/many", UploadId=upload_id)
    assert error_code(exc) == "NoSuchUpload"


def test_upload_fileobj_with_checksums(s3: Any) -> None:
    data = os.urandom(3 * MIN_PART + 77)
    config = boto3.s3.transfer.TransferConfig(multipart_threshold=MIN_PART, multipart_chunksize=MIN_PART,
                                              max_concurrency=4)
    s3.upload_fileobj(io.BytesIO(data), B, "mp/transfer", Config=config,
                      ExtraArgs={"ChecksumAlgorithm": "SHA256"})
    head = s3.head_object(Bucket=B, Key="mp/transfer", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(data)
    assert head["ChecksumSHA256"].endswith("-4")  # composite: the checksum of the part checksums
    out = io.BytesIO()
    s3.download_fileobj(B, "mp/transfer", out, Config=config)
    assert out.getvalue() == data


def test_completion_errors(s3: Any) -> None:
    parts = [os.urandom(MIN_PART), os.urandom(1000), os.urandom(1000)]
    upload_id, done = _upload_parts(s3, "mp/errors", parts)

    def complete(part_list: list[dict[str, Any]], key: str = "mp/errors", uid: str = upload_id) -> Any:
        return s3.complete_multipart_upload(Bucket=B, Key=key, UploadId=uid, MultipartUpload={"Parts": part_list})

    with pytest.raises(ClientError) as exc:
        complete([done[0], {"PartNumber": 2, "ETag": '"0123456789abcdef"'}])
    assert error_code(exc) == "InvalidPart"
    with pytest.raises(ClientError) as exc:
        complete([done[0], {"PartNumber": 9, "ETag": done[1]["ETag"]}])
    assert error_code(exc) == "InvalidPart"
    with pytest.raises(ClientError) as exc:
        complete([done[1], done[0]])
    assert error_code(exc) == "InvalidPartOrder"
    with pytest.raises(ClientError) as exc:
        complete(done)  # part 2 is below the minimum and not last
    assert error_code(exc) == "EntityTooSmall"
    with pytest.raises(ClientError) as exc:
        complete(done, uid="0" * 32)
    assert error_code(exc) == "NoSuchUpload" and status(exc) == 404
    with pytest.raises(ClientError) as exc:
        complete(done, uid="../../etc")
    assert error_code(exc) == "NoSuchUpload"
    with pytest.raises(ClientError) as exc:
        complete(done, key="mp/other-key")
    assert error_code(exc) == "NoSuchUpload"
    # a subset of the parts is fine: the object is parts 1 and 3
    complete([done[0], done[2]])
    assert s3.get_object(Bucket=B, Key="mp/errors")["Body"].read() == parts[0] + parts[2]


def test_part_reupload_replaces_it(s3: Any) -> None:
    upload_id = s3.create_multipart_upload(Bucket=B, Key="mp/redo")["UploadId"]
    s3.upload_part(Bucket=B, Key="mp/redo", UploadId=upload_id, PartNumber=1, Body=b"old")
    etag = s3.upload_part(Bucket=B, Key="mp/redo", UploadId=upload_id, PartNumber=1, Body=b"new!")["ETag"]
    s3.complete_multipart_upload(Bucket=B, Key="mp/redo", UploadId=upload_id,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert s3.get_object(Bucket=B, Key="mp/redo")["Body"].read() == b"new!"


def test_abort(s3_server: ServerProcess, s3: Any) -> None:
    upload_id, _ = _upload_parts(s3, "mp/abort", [os.urandom(1000)])
    staging = s3_server.data_dir / "fs" / "multipart" / upload_id
    assert staging.is_dir()
    s3.abort_multipart_upload(Bucket=B, Key="mp/abort", UploadId=upload_id)
    assert not staging.exists()
    with pytest.raises(ClientError) as exc:
        s3.upload_part(Bucket=B, Key="mp/abort", UploadId=upload_id, PartNumber=1, Body=b"x")
    assert error_code(exc) == "NoSuchUpload"
    with pytest.raises(ClientError) as exc:
        s3.abort_multipart_upload(Bucket=B, Key="mp/abort", UploadId=upload_id)
    assert error_code(exc) == "NoSuchUpload"


def test_complete_is_write_once(s3: Any) -> None:
    first = s3.put_object(Bucket=B, Key="mp/exists", Body=b"original")["ETag"]
    upload_id, done = _upload_parts(s3, "mp/exists", [os.urandom(100)])
    result = s3.complete_multipart_upload(Bucket=B, Key="mp/exists", UploadId=upload_id,
                                          MultipartUpload={"Parts": done})
    assert result["ETag"] == first
    assert s3.get_object(Bucket=B, Key="mp/exists")["Body"].read() == b"original"
    upload_id, done = _upload_parts(s3, "mp/exists", [os.urandom(100)])
    with pytest.raises(ClientError) as exc:
        s3.complete_multipart_upload(Bucket=B, Key="mp/exists", UploadId=upload_id,
                                     MultipartUpload={"Parts": done}, IfNoneMatch="*")
    assert error_code(exc) == "PreconditionFailed"


def test_object_size_header_is_checked(s3_server: ServerProcess, s3: Any) -> None:
    from tests.integration.s3api.wire import send

    upload_id, done = _upload_parts(s3, "mp/size", [b"12345"])
    body = (f"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>{done[0]['ETag'].strip(chr(34))}"
            "</ETag></Part></CompleteMultipartUpload>").encode()
    r = send(s3_server.url, "POST", f"/{B}/mp/size", query=f"uploadId={upload_id}", body=body,
             headers={"x-amz-mp-object-size": "6"})
    assert r.status_code == 400 and b"<Code>InvalidRequest</Code>" in r.content
    r = send(s3_server.url, "POST", f"/{B}/mp/size", query=f"uploadId={upload_id}", body=body,
             headers={"x-amz-mp-object-size": "5"})
    assert r.status_code == 200, r.text
    assert s3.get_object(Bucket=B, Key="mp/size")["Body"].read() == b"12345"


def test_upload_completes_on_another_gateway(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    shared = tmp_path / "shared-fs"
    a = server_factory(data_dir=tmp_path / "a", env={"KVGW_FS_ROOT": str(shared)}).start()
    b = server_factory(data_dir=tmp_path / "b", env={"KVGW_FS_ROOT": str(shared)}).start()
    s3a, s3b = boto3_client(a.url), boto3_client(b.url)
    parts = [os.urandom(MIN_PART), os.urandom(4321)]
    upload_id = s3a.create_multipart_upload(Bucket=B, Key="shared/obj")["UploadId"]
    e1 = s3a.upload_part(Bucket=B, Key="shared/obj", UploadId=upload_id, PartNumber=1, Body=parts[0])["ETag"]
    e2 = s3b.upload_part(Bucket=B, Key="shared/obj", UploadId=upload_id, PartNumber=2, Body=parts[1])["ETag"]
    assert len(s3b.list_parts(Bucket=B, Key="shared/obj", UploadId=upload_id)["Parts"]) == 2
    s3b.complete_multipart_upload(Bucket=B, Key="shared/obj", UploadId=upload_id, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]})
    assert s3a.get_object(Bucket=B, Key="shared/obj")["Body"].read() == b"".join(parts)


def test_stale_uploads_are_swept(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "data", env={
        "KVGW_S3_API_MULTIPART_MAX_AGE_SECONDS": "1", "KVGW_S3_API_SWEEP_INTERVAL_SECONDS": "0.2"}).start()
    s3 = boto3_client(server.url)
    upload_id = s3.create_multipart_upload(Bucket=B, Key="stale")["UploadId"]
    s3.upload_part(Bucket=B, Key="stale", UploadId=upload_id, PartNumber=1, Body=b"x" * 1000)
    staging = server.data_dir / "fs" / "multipart" / upload_id
    deadline = time.monotonic() + 15
    while staging.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not staging.exists()
    with pytest.raises(ClientError) as exc:
        s3.list_parts(Bucket=B, Key="stale", UploadId=upload_id)
    assert error_code(exc) == "NoSuchUpload"


def test_upload_bigger_than_the_bucket_limit(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory(data_dir=tmp_path / "data", env={"KVGW_MAX_CHUNK_BYTES": str(12 * MiB)}).start()
    s3 = boto3_client(server.url)
    upload_id, done = _upload_parts(s3, "big", [os.urandom(MIN_PART)] * 3)
    with pytest.raises(ClientError) as exc:
        s3.complete_multipart_upload(Bucket=B, Key="big", UploadId=upload_id, MultipartUpload={"Parts": done})
    assert error_code(exc) == "EntityTooLarge"
