"""Building blocks of the S3 API, free of any HTTP server: import the modules directly.

- ``errors``: S3 error codes -> status and message, ``S3Error`` and its subclasses, the error XML.
- ``sigv4``: canonical request / string to sign / signing keys, as S3 clients compute them.
- ``auth``: SigV4 header and presigned-URL verification (``parse_request``, ``verify``).
- ``checksums``: x-amz-checksum-* and Content-MD5 algorithms behind one incremental interface.
- ``chunked``: streaming aws-chunked decoder with chunk-signature and trailer verification.
- ``payload``: one-pass body verification driven by the request headers (``open_payload``).
- ``xml``: response documents and safe parsing of request documents.
"""
