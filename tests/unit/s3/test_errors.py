"""The error table and the error document, checked against botocore's error parsing."""

from __future__ import annotations

import inspect
from xml.etree import ElementTree

import pytest
from botocore.exceptions import ClientError

from gateway.api.s3 import errors
from gateway.api.s3.errors import ERRORS, S3Error, error_response, render_error
from tests.unit.s3.clients import make_client

REQUIRED = {
    "NoSuchBucket": 404,
    "NoSuchKey": 404,
    "NoSuchUpload": 404,
    "InvalidPart": 400,
    "InvalidPartOrder": 400,
    "EntityTooSmall": 400,
    "EntityTooLarge": 400,
    "InvalidRange": 416,
    "SignatureDoesNotMatch": 403,
    "InvalidAccessKeyId": 403,
    "AccessDenied": 403,
    "RequestTimeTooSkewed": 403,
    "MissingContentLength": 411,
    "IncompleteBody": 400,
    "BadDigest": 400,
    "InvalidDigest": 400,
    "XAmzContentSHA256Mismatch": 400,
    "PreconditionFailed": 412,
    "BucketNotEmpty": 409,
    "BucketAlreadyOwnedByYou": 409,
    "BucketAlreadyExists": 409,
    "InvalidBucketName": 400,
    "MalformedXML": 400,
    "NotImplemented": 501,
    "InvalidArgument": 400,
    "InvalidRequest": 400,
    "MethodNotAllowed": 405,
    "AuthorizationHeaderMalformed": 400,
    "ServiceUnavailable": 503,
    "InternalError": 500,
    "SlowDown": 503,
    "NotModified": 304,
    "AuthorizationQueryParametersError": 400,
    "MissingSecurityHeader": 400,
}


@pytest.mark.parametrize(("code", "status"), sorted(REQUIRED.items()))
def test_table(code: str, status: int) -> None:
    error = S3Error(code)
    assert error.status == status and error.message == ERRORS[code].message


def test_every_fixed_code_class_is_in_the_table() -> None:
    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors._Coded) and c is not errors._Coded
    ]
    assert len(classes) > 10
    for cls in classes:
        assert cls.CODE in ERRORS
        assert cls().code == cls.CODE


def test_unknown_code_fails_early() -> None:
    with pytest.raises(KeyError):
        S3Error("NoSuchThing")


def test_render_with_extras() -> None:
    error = S3Error("NoSuchKey", Key="a<b>&c", extra={"X-Amz-Odd": 3})
    body = render_error(error, resource="/bkt/a<b>&c", request_id="req1")
    root = ElementTree.fromstring(body)
    assert [child.tag for child in root] == ["Code", "Message", "X-Amz-Odd", "Key", "Resource", "RequestId"]
    assert root.findtext("Key") == "a<b>&c" and root.findtext("X-Amz-Odd") == "3"
    assert root.findtext("Resource") == "/bkt/a<b>&c" and root.findtext("RequestId") == "req1"


@pytest.mark.parametrize("code", ["NoSuchKey", "SignatureDoesNotMatch", "SlowDown", "InvalidRange"])
def test_botocore_reads_our_errors(code: str) -> None:
    error = S3Error(code, Key="k")
    response = error_response(error, resource="/bkt/k", request_id="r-1")
    headers = {k.decode(): v.decode() for k, v in response.headers}
    client = make_client(response=(response.status, headers, response.body), retries={"total_max_attempts": 1})
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket="bkt", Key="k")
    assert info.value.response["Error"]["Code"] == code
    assert info.value.response["Error"]["Message"] == error.message
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == error.status
    assert info.value.response["ResponseMetadata"]["RequestId"] == "r-1"


def test_no_body_for_head_and_304() -> None:
    head = error_response(S3Error("NoSuchKey"), head=True)
    assert head.status == 404 and head.body == b""
    not_modified = error_response(S3Error("NotModified", headers={"ETag": '"abc"'}), request_id="r")
    assert not_modified.status == 304 and not_modified.body == b""
    assert (b"etag", b'"abc"') in not_modified.headers and (b"x-amz-request-id", b"r") in not_modified.headers
    full = error_response(S3Error("NoSuchKey"))
    assert (b"content-type", b"application/xml") in full.headers
