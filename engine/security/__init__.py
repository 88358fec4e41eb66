"""Federation security: certificates, site keys, enrolment and app approval.

- :mod:`engine.security.certs`: a federation CA, the coordinator's TLS certificate and one
  key pair per site (``cryptography``; private keys written with mode 0600).
- :mod:`engine.security.enrollment`: the coordinator's register of site public keys (a site
  whose key is not enrolled cannot connect: SuperNode authentication).
- :mod:`engine.security.approval`: a site runs only an app whose hash it pinned in ``site.toml``.
"""
