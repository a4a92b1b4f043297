"""GetObject for an S3 client that checks what it reads (``x-amz-checksum-mode: ENABLED``): the stored
checksum comes with the object (S3's CRC64NVME when the PUT carried none) and the bytes come from the
chunk file unverified by kvgw, since the client verifies them; clients that do not ask keep kvgw's
own verification. boto3 against a real ``kvgw serve``."""

from __future__ import annotations

import os
from typing import Any

import botocore.exceptions
import pytest

from tests.conftest import ServerProcess
from tests.integration.s3api.conftest import MiB, boto3_client
from tests.integration.test_integrity import chunk_path, flip_byte


@pytest.mark.parametrize(("sent", "stored"), [("when_required", "ChecksumCRC64NVME"),
                                                ("when_supported", "ChecksumCRC32")])
def test_checksum_mode_reads_carry_a_stored_checksum_and_skip_server_verification(
        s3_server: ServerProcess, sent: str, stored: str) -> None:
    s3: Any = boto3_client(s3_server.url, request_checksum_calculation=sent,
                           response_checksum_validation="when_required")
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket="kvcache", Key="obj", Body=data)  # "when_required": no checksum sent at all
    got = s3.get_object(Bucket="kvcache", Key="obj", ChecksumMode="ENABLED")
    assert got["Body"].read() == data and stored in got  # and boto3 checked it against the bytes
    head = s3.head_object(Bucket="kvcache", Key="obj", ChecksumMode="ENABLED")
    assert head[stored] == got[stored]

    flip_byte(chunk_path(s3_server, "obj"), MiB)  # bitrot behind the gateway's back
    with pytest.raises(botocore.exceptions.FlexibleChecksumError):  # sent as it is: the client caught it
        s3.get_object(Bucket="kvcache", Key="obj", ChecksumMode="ENABLED")["Body"].read()
    assert chunk_path(s3_server, "obj").exists()  # kvgw read none of it
    with pytest.raises(botocore.exceptions.ClientError, match="NoSuchKey"):  # a plain GET: kvgw verifies
        s3.get_object(Bucket="kvcache", Key="obj")["Body"].read()
    assert not chunk_path(s3_server, "obj").exists()


def test_ranged_reads_are_verified_by_kvgw_whatever_the_mode(s3_server: ServerProcess) -> None:
    s3: Any = boto3_client(s3_server.url, response_checksum_validation="when_required")
    data = os.urandom(2 * MiB)
    s3.put_object(Bucket="kvcache", Key="ranged", Body=data)
    flip_byte(chunk_path(s3_server, "ranged"), 10)
    with pytest.raises(botocore.exceptions.ClientError, match="NoSuchKey"):
        s3.get_object(Bucket="kvcache", Key="ranged", Range="bytes=100-199", ChecksumMode="ENABLED")
