"""SigV4 verification against what real clients (botocore, awscrt) sign."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote_to_bytes

import pytest
from botocore.auth import HmacV1Auth, HmacV1QueryAuth, S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from gateway.api.s3 import sigv4
from gateway.api.s3.auth import PayloadMode, authenticate, parse_request, verify
from gateway.api.s3.errors import (
    AccessDenied,
    AuthorizationHeaderMalformed,
    AuthorizationQueryParametersError,
    InvalidAccessKeyId,
    MissingSecurityHeader,
    RequestTimeTooSkewed,
    S3Error,
    SignatureDoesNotMatch,
    UnsupportedAuthorization,
)
from tests.requirements import require_module
from tests.unit.s3.clients import (
    ACCESS_KEY,
    NOW,
    SECRET,
    SECRETS,
    Wire,
    boto_wire,
    botocore_signer,
    frozen_clock,
    make_client,
    presigned_wire,
    wire_from_prepared,
)


@pytest.fixture(autouse=True, params=["python", "crt"])
def signer(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every botocore-signed case runs with botocore's Python signer and with its awscrt signer."""
    if request.param == "crt":
        require_module("awscrt")
    with botocore_signer(request.param):
        yield request.param


KEYS = [
    "plain",
    "my key",
    "sp  aces  ",
    "dir/sub/file.bin",
    "a@b",
    "a%40b",
    "model@1@0@270fff4c@bfloat16",
    "ünïcødé/日本語/😀",
    "plus+sign",
    "!*'()$,;=&:",
    "~tilde_dash-dot.",
    "question?mark#hash",
    "//double//slash/",
]


def _put(key: str, body: bytes = b"hello") -> Any:
    return lambda c: c.put_object(Bucket="bkt", Key=key, Body=body)


@pytest.mark.parametrize("key", KEYS)
def test_botocore_put_signed_payload_over_http(key: str) -> None:
    wire = boto_wire(_put(key))
    result = wire.authenticate()
    assert result.access_key == ACCESS_KEY
    assert result.payload_mode is PayloadMode.SHA256
    assert result.payload_hash == hashlib.sha256(b"hello").hexdigest()
    assert result.region == "us-east-1" and result.date == "20240501"
    assert result.scope == "20240501/us-east-1/s3/aws4_request"
    assert not result.presigned


@pytest.mark.parametrize("key", KEYS)
def test_botocore_put_trailer_over_https(key: str) -> None:
    wire = boto_wire(_put(key), endpoint="https://gw.example")
    result = wire.authenticate()
    assert result.payload_mode is PayloadMode.STREAMING_UNSIGNED_TRAILER
    assert wire.header("x-amz-trailer") == b"x-amz-checksum-crc32"


def test_botocore_unsigned_payload() -> None:
    wire = boto_wire(
        _put("k"),
        endpoint="https://gw.example",
        s3={"payload_signing_enabled": False, "addressing_style": "path"},
        request_checksum_calculation="when_required",
    )
    result = wire.authenticate()
    assert result.payload_mode is PayloadMode.UNSIGNED
    assert result.payload_hash == "UNSIGNED-PAYLOAD"


def test_result_carries_what_chunk_verification_needs() -> None:
    wire = boto_wire(_put("k"))
    result = wire.authenticate()
    authorization = wire.header("authorization")
    assert authorization is not None
    assert authorization.decode().endswith("Signature=" + result.seed_signature)
    assert result.signing_key == sigv4.signing_key(SECRET, "20240501", "us-east-1", "s3")
    assert result.timestamp == "20240501T120000Z"
    assert "signing_key" not in repr(result) and SECRET not in repr(result)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.list_objects_v2(Bucket="bkt", Prefix="a b+c/ü", Delimiter="/", StartAfter="x y"),
        lambda c: c.list_objects_v2(Bucket="bkt", ContinuationToken="abc+/=def==", MaxKeys=7),
        lambda c: c.list_objects(Bucket="bkt", Marker="m@rk%er", Prefix=""),
        lambda c: c.create_multipart_upload(Bucket="bkt", Key="big file"),
        lambda c: c.upload_part(Bucket="bkt", Key="k", UploadId="u/p+id=", PartNumber=3, Body=b"x"),
        lambda c: c.list_parts(Bucket="bkt", Key="k", UploadId="id", PartNumberMarker=2),
        lambda c: c.list_multipart_uploads(Bucket="bkt", Prefix="p", KeyMarker="k m"),
        lambda c: c.delete_objects(Bucket="bkt", Delete={"Objects": [{"Key": "a"}], "Quiet": True}),
        lambda c: c.get_object(Bucket="bkt", Key="k", Range="bytes=0-8388607", IfMatch='"etag"'),
        lambda c: c.head_object(Bucket="bkt", Key="a@b"),
        lambda c: c.list_buckets(),
        lambda c: c.get_bucket_location(Bucket="bkt"),
        lambda c: c.put_object(Bucket="bkt", Key="k", Body=b"v", Metadata={"name": "  a   b  "}),
        lambda c: c.put_object(Bucket="bkt", Key="k", Body=b"v", ContentDisposition="attachment; filename=café"),
        lambda c: c.copy_object(Bucket="bkt", Key="k", CopySource={"Bucket": "src", "Key": "a b/ü"}),
    ],
)
def test_botocore_operations(call: Any) -> None:
    wire = boto_wire(call)
    assert wire.authenticate().access_key == ACCESS_KEY


def test_virtual_hosted_style() -> None:
    wire = boto_wire(_put("dir/my key"), endpoint="http://gw.example:9000", s3={"addressing_style": "virtual"})
    assert wire.header("host") == b"bkt.gw.example:9000"
    assert wire.raw_path == b"/dir/my%20key"
    wire.authenticate()


def _signed_request(
    url: str, *, headers: dict[str, str] | None = None, params: Any = None, method: str = "GET"
) -> Wire:
    """Sign with botocore's S3 signer directly, for shapes no operation produces."""
    request = AWSRequest(method=method, url=url, headers=headers or {}, params=params or {})
    with frozen_clock():
        S3SigV4Auth(Credentials(ACCESS_KEY, SECRET), "s3", "us-east-1").add_auth(request)
    return wire_from_prepared(request.prepare()).with_header("host", b"gw.example")


@pytest.mark.parametrize(
    "query",
    [
        "uploads",
        "acl=",
        "a=2&a=1&b=",
        "b=x&a=y&A=z",
        "k=%2F%2B%20&k2=~-_.",
        "unicode=%C3%BC&empty&=v",
        "prefix=&delimiter=%2F&list-type=2",
    ],
)
def test_query_shapes(query: str) -> None:
    """botocore signs a URL's query as written: write it as botocore's serializer would."""
    _signed_request(f"http://gw.example/bkt/k?{query}").authenticate()


def test_plus_in_query_means_space() -> None:
    """urlencode-style clients (minio-go, botocore params) send '+' and sign '%20'."""
    wire = _signed_request("http://gw.example/bkt/k", params={"prefix": "a b"})
    assert wire.query == b"prefix=a+b"
    wire.authenticate()


def test_multiple_values_via_params() -> None:
    wire = _signed_request("http://gw.example/bkt/k", params=[("b", "2"), ("a", "x y"), ("a", "1"), ("c", "")])
    wire.authenticate()


def test_date_header_instead_of_x_amz_date() -> None:
    wire = _signed_request(
        "http://gw.example/bkt/k", headers={"Date": "Wed, 01 May 2024 12:00:00 GMT", "X-Amz-Content-SHA256": "x"}
    )
    assert wire.header("x-amz-date") is None
    assert wire.authenticate().timestamp == "20240501T120000Z"


def test_latin1_header_signed_as_utf8() -> None:
    """http.client sends str header values as latin-1 while the signer hashed UTF-8."""
    request = AWSRequest(method="PUT", url="http://gw.example/bkt/k", headers={"x-amz-meta-n": "café"})
    with frozen_clock():
        S3SigV4Auth(Credentials(ACCESS_KEY, SECRET), "s3", "us-east-1").add_auth(request)
    headers = [(k.lower().encode(), v.encode("latin-1")) for k, v in request.headers.items()]
    headers.append((b"host", b"gw.example"))
    Wire("PUT", b"/bkt/k", b"", headers).authenticate()


def test_unencoded_path_characters_match_encoded_canonical_form() -> None:
    """A client that leaves '@' unencoded on the wire but signs the encoded path still passes."""
    wire = boto_wire(_put("a@b c"))
    assert wire.raw_path == b"/bkt/a%40b%20c"
    wire_raw_at = Wire(wire.method, b"/bkt/a@b%20c", wire.query, wire.headers, wire.body)
    wire_raw_at.authenticate()



def test_canonical_uri_candidates_for_every_byte_and_escape() -> None:
    """The shortcut for paths already in canonical form gives what decoding and re-encoding gives, for
    every byte sent literally and escaped in upper and lower case."""
    for byte in range(256):
        for raw in (b"/bkt/k%%%02X" % byte, b"/bkt/k%%%02x" % byte, b"/bkt/k" + bytes([byte])):
            encoded = sigv4.uri_encode(unquote_to_bytes(raw), keep_slash=True)
            expected = [raw] if encoded == raw else [raw, encoded]
            assert sigv4.canonical_uris(raw) == expected, raw

# -- awscrt (what LMCache's S3 connector uses) ----------------------------------------------------------


def _crt_sign(method: str, path: str, headers: list[tuple[str, str]]) -> Wire:
    auth = require_module("awscrt.auth")
    http = require_module("awscrt.http")
    request = http.HttpRequest(method, path, http.HttpHeaders(headers))
    config = auth.AwsSigningConfig(
        algorithm=auth.AwsSigningAlgorithm.V4,
        signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
        credentials_provider=auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET),
        region="us-east-1",
        service="s3",
        date=NOW,
        use_double_uri_encode=False,
        should_normalize_uri_path=False,
        signed_body_value=auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD,
        signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
    )
    auth.aws_sign_request(request, config).result()
    raw_path, _, query = request.path.partition("?")
    pairs = [(k.lower().encode(), v.encode("utf-8")) for k, v in request.headers]
    return Wire(method, raw_path.encode(), query.encode(), pairs)


def test_awscrt_lmcache_shape() -> None:
    key = "model@1@0@270fff4c@bfloat16"
    for method in ("HEAD", "PUT", "GET"):
        wire = _crt_sign(method, "/" + quote(key), [("Host", "127.0.0.1:9000")])
        result = wire.authenticate()
        assert result.payload_mode is PayloadMode.UNSIGNED


def test_awscrt_multipart_query_and_repeated_headers() -> None:
    wire = _crt_sign(
        "PUT",
        "/model%401%400?partNumber=2&uploadId=abc%2Bdef",
        [("Host", "127.0.0.1:9000"), ("x-amz-meta-a", "1"), ("X-Amz-Meta-A", "2"), ("x-amz-meta-u", "é")],
    )
    wire.authenticate()


# -- tampering -----------------------------------------------------------------------------------------


@pytest.fixture
def signed() -> Wire:
    return boto_wire(lambda c: c.put_object(Bucket="bkt", Key="k", Body=b"v", Metadata={"m": "1"}))


def test_untampered_baseline(signed: Wire) -> None:
    signed.authenticate()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda w: Wire("POST", w.raw_path, w.query, w.headers),
        lambda w: Wire(w.method, w.raw_path + b"x", w.query, w.headers),
        lambda w: Wire(w.method, b"/bkt/K", w.query, w.headers),
        lambda w: Wire(w.method, w.raw_path, b"uploads", w.headers),
        lambda w: w.with_header("x-amz-meta-m", b"2"),
        lambda w: w.with_header("host", b"other.example:9000"),
        lambda w: w.with_header("x-amz-date", b"20240501T120001Z"),
        lambda w: w.with_header("x-amz-content-sha256", hashlib.sha256(b"w").hexdigest().encode()),
        lambda w: w.with_header("x-amz-content-sha256", b"UNSIGNED-PAYLOAD"),
    ],
    ids=["method", "path", "path-case", "query", "header", "host", "date", "payload-hash", "payload-mode"],
)
def test_tampering_is_detected(signed: Wire, tamper: Any) -> None:
    with pytest.raises(SignatureDoesNotMatch) as info:
        tamper(signed).authenticate()
    assert info.value.status == 403
    assert "CanonicalRequest" in info.value.extra and "StringToSign" in info.value.extra


def test_unsigned_extra_header_does_not_break_signature(signed: Wire) -> None:
    signed.with_header("x-forwarded-for", b"10.0.0.1").authenticate()


def test_wrong_secret_and_unknown_key(signed: Wire) -> None:
    claim = parse_request(signed.method, signed.raw_path, signed.query, signed.headers, now=NOW)
    with pytest.raises(SignatureDoesNotMatch):
        verify(claim, "not-the-secret")
    with pytest.raises(InvalidAccessKeyId):
        authenticate(signed.method, signed.raw_path, signed.query, signed.headers, lambda _: None, now=NOW)


@pytest.mark.parametrize(("minutes", "ok"), [(14, True), (-14, True), (16, False), (-16, False)])
def test_clock_skew(signed: Wire, minutes: int, ok: bool) -> None:
    now = NOW + timedelta(minutes=minutes)
    if ok:
        signed.authenticate(now=now)
    else:
        with pytest.raises(RequestTimeTooSkewed) as info:
            signed.authenticate(now=now)
        assert info.value.extra["MaxAllowedSkewMilliseconds"] == "900000"


def test_now_as_epoch_float(signed: Wire) -> None:
    signed.authenticate(now=NOW.timestamp() + 5)


def test_region_pinning(signed: Wire) -> None:
    signed.authenticate(region="us-east-1")
    with pytest.raises(AuthorizationHeaderMalformed) as info:
        signed.authenticate(region="eu-west-1")
    assert info.value.extra["Region"] == "eu-west-1"


# -- presigned URLs --------------------------------------------------------------------------------------


def _presign(method: str, params: dict[str, Any], expires: int = 3600, **kwargs: Any) -> str:
    client = make_client(signature_version="s3v4", **kwargs)
    with frozen_clock():
        return str(client.generate_presigned_url(method, Params=params, ExpiresIn=expires))


@pytest.mark.parametrize("key", ["k", "my key/ü", "a@b", "plus+sign"])
def test_presigned_get_and_put(key: str) -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": key})
    result = presigned_wire(url, "GET", "gw.example:9000").authenticate(now=NOW + timedelta(seconds=10))
    assert result.presigned and result.payload_mode is PayloadMode.UNSIGNED
    url = _presign("put_object", {"Bucket": "bkt", "Key": key})
    presigned_wire(url, "PUT", "gw.example:9000", b"body").authenticate(now=NOW + timedelta(minutes=59))


def test_presigned_virtual_host() -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"}, s3={"addressing_style": "virtual"})
    presigned_wire(url, "GET", "bkt.gw.example:9000").authenticate()


def test_presigned_expiry() -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"}, expires=60)
    wire = presigned_wire(url, "GET", "gw.example:9000")
    wire.authenticate(now=NOW + timedelta(seconds=60))
    with pytest.raises(AccessDenied, match="Request has expired") as info:
        wire.authenticate(now=NOW + timedelta(seconds=61))
    assert info.value.extra["X-Amz-Expires"] == "60"
    # no skew rule for presigned URLs: a long-lived URL is valid long after it was signed
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"}, expires=7 * 24 * 3600)
    presigned_wire(url, "GET", "gw.example:9000").authenticate(now=NOW + timedelta(days=6))
    with pytest.raises(AccessDenied, match="not valid yet"):
        presigned_wire(url, "GET", "gw.example:9000").authenticate(now=NOW - timedelta(hours=1))


def test_presigned_expires_over_a_week() -> None:
    request = AWSRequest(method="GET", url="http://gw.example/bkt/k")
    with frozen_clock():
        S3SigV4QueryAuth(Credentials(ACCESS_KEY, SECRET), "s3", "us-east-1", expires=604801).add_auth(request)
    with pytest.raises(AuthorizationQueryParametersError, match="604800"):
        presigned_wire(request.url, "GET", "gw.example").authenticate()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda url: url.replace("/bkt/k?", "/bkt/j?"),
        lambda url: url.replace("X-Amz-Expires=3600", "X-Amz-Expires=3601"),
        lambda url: url + "&extra=1",
    ],
)
def test_presigned_tampering(tamper: Any) -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"})
    with pytest.raises(SignatureDoesNotMatch):
        presigned_wire(tamper(url), "GET", "gw.example:9000").authenticate()


def test_presigned_wrong_method() -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"})
    with pytest.raises(SignatureDoesNotMatch):
        presigned_wire(url, "PUT", "gw.example:9000").authenticate()


@pytest.mark.parametrize(
    "drop", ["X-Amz-Credential=", "X-Amz-Date=", "X-Amz-Expires=", "X-Amz-SignedHeaders=", "X-Amz-Signature="]
)
def test_presigned_missing_parameter(drop: str) -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"})
    base, _, query = url.partition("?")
    query = "&".join(p for p in query.split("&") if not p.startswith(drop))
    with pytest.raises(AuthorizationQueryParametersError):
        presigned_wire(base + "?" + query, "GET", "gw.example:9000").authenticate()


def test_presigned_bad_algorithm() -> None:
    url = _presign("get_object", {"Bucket": "bkt", "Key": "k"})
    url = url.replace("X-Amz-Algorithm=AWS4-HMAC-SHA256", "X-Amz-Algorithm=AWS4-ECDSA-P256-SHA256")
    with pytest.raises(AuthorizationQueryParametersError):
        presigned_wire(url, "GET", "gw.example:9000").authenticate()


# -- unsupported and malformed -----------------------------------------------------------------------------


def test_sigv2_header_is_rejected_clearly() -> None:
    request = AWSRequest(method="GET", url="http://gw.example/bkt/k")
    HmacV1Auth(Credentials(ACCESS_KEY, SECRET)).add_auth(request)
    headers = [(k.lower().encode(), v.encode()) for k, v in request.headers.items()]
    with pytest.raises(UnsupportedAuthorization, match="AWS4-HMAC-SHA256") as info:
        Wire("GET", b"/bkt/k", b"", headers).authenticate()
    assert info.value.code == "InvalidRequest" and info.value.status == 400


def test_botocore_default_presign_is_sigv2_and_rejected() -> None:
    client = make_client()
    url = client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": "k"}, ExpiresIn=60)
    with pytest.raises(UnsupportedAuthorization):
        presigned_wire(url, "GET", "gw.example:9000").authenticate()


def test_sigv2_query_is_rejected_clearly() -> None:
    request = AWSRequest(method="GET", url="http://gw.example/bkt/k")
    HmacV1QueryAuth(Credentials(ACCESS_KEY, SECRET), expires=60).add_auth(request)
    with pytest.raises(UnsupportedAuthorization):
        presigned_wire(request.url, "GET", "gw.example").authenticate()


def test_anonymous_request() -> None:
    with pytest.raises(AccessDenied):
        Wire("GET", b"/bkt/k", b"", [(b"host", b"gw.example")]).authenticate()


def test_header_and_query_auth_together(signed: Wire) -> None:
    url = _presign("put_object", {"Bucket": "bkt", "Key": "k"})
    query = url.partition("?")[2].encode()
    with pytest.raises(S3Error) as info:
        Wire(signed.method, signed.raw_path, query, signed.headers).authenticate()
    assert info.value.code == "InvalidArgument"


def _with_authorization(wire: Wire, value: str) -> Wire:
    return wire.with_header("authorization", value.encode())


@pytest.mark.parametrize(
    "authorization",
    [
        "AWS4-HMAC-SHA256",
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/s3/aws4_request",
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/s3/aws4_request, SignedHeaders=host",
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/s3, SignedHeaders=host, Signature=" + "0" * 64,
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240502/us-east-1/s3/aws4_request, SignedHeaders=host, "
        "Signature=" + "0" * 64,
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/sqs/aws4_request, SignedHeaders=host, "
        "Signature=" + "0" * 64,
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/s3/aws4_request, SignedHeaders=x-amz-date, "
        "Signature=" + "0" * 64,
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240501/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=xyz",
        "Bearer token",
    ],
)
def test_malformed_authorization(signed: Wire, authorization: str) -> None:
    with pytest.raises(AuthorizationHeaderMalformed) as info:
        _with_authorization(signed, authorization).authenticate()
    assert info.value.status == 400


@pytest.mark.parametrize(
    "form",
    [
        "AWS4-HMAC-SHA256 Credential={c}, SignedHeaders={h}, Signature={s}",  # botocore, aws-sdk-cpp, minio-go
        "AWS4-HMAC-SHA256 Credential={c},SignedHeaders={h},Signature={s}",
        "AWS4-HMAC-SHA256 Signature={s}, Credential={c}, SignedHeaders={h}",
        "AWS4-HMAC-SHA256  Credential={c} ,  SignedHeaders={h},Signature={s} ",
    ],
)
def test_every_accepted_authorization_form_verifies_alike(signed: Wire, form: str) -> None:
    """The usual form is read by one regular expression, the others field by field: both find the same
    credential, signed headers and signature, so the request verifies either way."""
    raw = signed.header("authorization")
    assert raw is not None
    fields = dict(item.strip().split("=", 1) for item in raw.decode().removeprefix("AWS4-HMAC-SHA256 ").split(","))
    value = form.format(c=fields["Credential"], h=fields["SignedHeaders"], s=fields["Signature"])
    result = _with_authorization(signed, value).authenticate()
    assert (result.access_key, result.seed_signature) == (ACCESS_KEY, fields["Signature"])
    assert ",".join(result.signed_headers) == fields["SignedHeaders"].replace(";", ",")
    with pytest.raises(SignatureDoesNotMatch):
        _with_authorization(signed, value.replace(fields["Signature"], "0" * 64)).authenticate()


def test_sigv4a_is_unsupported(signed: Wire) -> None:
    with pytest.raises(UnsupportedAuthorization):
        _with_authorization(
            signed, "AWS4-ECDSA-P256-SHA256 Credential=x, SignedHeaders=host, Signature=y"
        ).authenticate()


def test_missing_content_sha256(signed: Wire) -> None:
    with pytest.raises(MissingSecurityHeader):
        signed.with_header("x-amz-content-sha256", None).authenticate()


def test_invalid_content_sha256(signed: Wire) -> None:
    with pytest.raises(S3Error) as info:
        signed.with_header("x-amz-content-sha256", b"nonsense").authenticate()
    assert info.value.code == "InvalidArgument"


def test_missing_or_bad_date(signed: Wire) -> None:
    with pytest.raises(AccessDenied, match="Date"):
        signed.with_header("x-amz-date", None).authenticate()
    with pytest.raises(AccessDenied, match="Date"):
        signed.with_header("x-amz-date", b"2024-05-01T12:00:00Z").authenticate()


def test_two_authorization_headers(signed: Wire) -> None:
    auth = signed.header("authorization")
    assert auth is not None
    doubled = Wire(signed.method, signed.raw_path, signed.query, [*signed.headers, (b"authorization", auth)])
    with pytest.raises(AuthorizationHeaderMalformed):
        doubled.authenticate()


def test_header_mapping_input(signed: Wire) -> None:
    mapping = {k.decode(): v.decode() for k, v in signed.headers}
    parse_request(signed.method, signed.raw_path.decode(), "", mapping, now=NOW)
    assert SECRETS[ACCESS_KEY] == SECRET
