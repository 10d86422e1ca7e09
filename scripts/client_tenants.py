#!/usr/bin/env python3
"""Tenants and API keys through the Python client generated from openapi/openapi.json,
against a running service configured with `API_KEYS=admin:<key>` (docs/tenants.md): the
document must describe key management and the tenants' answers well enough for a
generated client to use them.

scripts/check-api.sh generates the client (package `transfer_service_client`) and runs

    python scripts/client_tenants.py http://127.0.0.1:<port> <admin key>

With that platform admin key it makes keys for two tenants, opens accounts and moves
money with them, sees that one tenant's key meets another's accounts as if they did not
exist, lists the keys (never their secrets) and revokes one. Any answer other than the
one expected stops it with a non-zero exit status; the client raises on a status the
document does not declare for the operation.
"""

from __future__ import annotations

import re
import sys
import uuid
from http import HTTPStatus

import attrs
from client_smoke import Mismatch, answer, expect
from transfer_service_client import AuthenticatedClient
from transfer_service_client.api.accounts import create_account, get_account, list_accounts
from transfer_service_client.api.api_keys import create_api_key, delete_api_key, list_api_keys
from transfer_service_client.api.transfers import create_transfer
from transfer_service_client.models import (
    AccountPage,
    AccountResponse,
    ApiKeyPage,
    ApiKeyResponse,
    CreateAccountRequest,
    CreateApiKeyRequest,
    CreatedApiKey,
    CreateTransferRequest,
    Problem,
    TransferResponse,
    TransferStateSchema,
)
from transfer_service_client.types import Response

# docs/tenants.md: `tsk_` and 32 random bytes in base64url; a public id of 32 hex digits.
SECRET = re.compile(r"^tsk_[A-Za-z0-9_-]{43}$")
KEY_ID = re.compile(r"^[0-9a-f]{32}$")


def client(base_url: str, key: str) -> AuthenticatedClient:
    return AuthenticatedClient(
        base_url=base_url, token=key, raise_on_unexpected_status=True, timeout=30.0
    )


def refused(response: Response, status: HTTPStatus, code: str, what: str) -> Problem:
    """The typed problem of `response`, which must have this status and code."""
    problem = answer(response, status, Problem, what)
    expect(
        (problem.status, problem.code, problem.type_)
        == (status.value, code, f"urn:transfer-service:problem:{code}"),
        f"{what}: expected {status.value} {code}, got {problem}",
    )
    return problem


def make_key(admin: AuthenticatedClient, tenant: str | None, role: str) -> CreatedApiKey:
    body = CreateApiKeyRequest(role=role)
    if tenant is not None:
        body.tenant = tenant
    response = create_api_key.sync_detailed(client=admin, body=body)
    made = answer(response, HTTPStatus.CREATED, CreatedApiKey, f"POST /api-keys {tenant} {role}")
    expect(
        SECRET.match(made.key) is not None and KEY_ID.match(made.id) is not None,
        f"the key's secret is tsk_ and 43 characters, its id 32 hex digits: {made.id}",
    )
    expect(made.last_used_at is None, f"a new key was never used: {made.last_used_at}")
    return made


def open_account(
    as_tenant: AuthenticatedClient, account_id: str, opening: int, tenant: str | None
) -> AccountResponse:
    """Opens an account with a tenant's key, naming `tenant` in the body or leaving it out."""
    body = CreateAccountRequest(id=account_id, balance=opening, currency="EUR")
    if tenant is not None:
        body.tenant = tenant
    response = create_account.sync_detailed(client=as_tenant, body=body)
    return answer(response, HTTPStatus.CREATED, AccountResponse, f"POST /accounts {account_id}")


def all_keys(admin: AuthenticatedClient, what: str) -> tuple[list[ApiKeyResponse], list[bytes]]:
    """Every key `admin` may list, page by page, and the raw bodies of the pages."""
    items: list[ApiKeyResponse] = []
    bodies: list[bytes] = []
    after = None
    for _ in range(100):
        kwargs = {"after": after} if after is not None else {}
        response = list_api_keys.sync_detailed(client=admin, limit=100, **kwargs)
        page = answer(response, HTTPStatus.OK, ApiKeyPage, what)
        items += page.items
        bodies.append(response.content)
        after = page.next_
        if after is None:
            return items, bodies
    raise Mismatch(f"{what}: more than 100 pages")


def run(base_url: str, admin_key: str) -> None:
    run_id = uuid.uuid4().hex[:12]
    acme, globex = f"acme-{run_id}", f"globex-{run_id}"
    acme_a, acme_b, globex_a = f"{acme}-a", f"{acme}-b", f"{globex}-a"

    # The listing's model has no field for a secret: the document keeps it to the answer
    # of POST /api-keys.
    listed_fields = {field.name for field in attrs.fields(ApiKeyResponse)}
    expect("key" not in listed_fields, f"the listed key's model has a secret: {listed_fields}")

    with client(base_url, admin_key) as platform:
        # Keys for two tenants, through the platform admin key of API_KEYS.
        acme_rw = make_key(platform, acme, "rw")
        acme_admin = make_key(platform, acme, "admin")
        globex_rw = make_key(platform, globex, "rw")
        expect(
            [(k.tenant, k.role) for k in (acme_rw, acme_admin, globex_rw)]
            == [(acme, "rw"), (acme, "admin"), (globex, "rw")],
            "the keys' tenants and roles",
        )

        with (
            client(base_url, acme_rw.key) as as_acme,
            client(base_url, acme_admin.key) as as_acme_admin,
            client(base_url, globex_rw.key) as as_globex,
        ):
            # A tenant's admin makes keys of its own tenant, never of another.
            acme_ro = make_key(as_acme_admin, None, "ro")
            expect(acme_ro.tenant == acme, f"a tenant's admin made a key of {acme_ro.tenant}")
            response = create_api_key.sync_detailed(
                client=as_acme_admin, body=CreateApiKeyRequest(role="rw", tenant=globex)
            )
            refused(response, HTTPStatus.FORBIDDEN, "forbidden", "a key for another tenant")
            # Only admin keys manage keys.
            response = list_api_keys.sync_detailed(client=as_globex)
            refused(response, HTTPStatus.FORBIDDEN, "forbidden", "GET /api-keys with an rw key")

            # Accounts opened with each tenant's key belong to that tenant, whether the
            # body names it or leaves it out.
            for as_tenant, account_id, opening, named, tenant in (
                (as_acme, acme_a, 10_000, None, acme),
                (as_acme, acme_b, 0, acme, acme),
                (as_globex, globex_a, 500, None, globex),
            ):
                account = open_account(as_tenant, account_id, opening, named)
                expect(
                    (account.id, account.tenant, account.balance) == (account_id, tenant, opening),
                    f"the opened account is {account}",
                )

            # Money moves within a tenant.
            response = create_transfer.sync_detailed(
                client=as_acme,
                body=CreateTransferRequest(source=acme_a, destination=acme_b, amount=2_500),
            )
            transfer = answer(response, HTTPStatus.CREATED, TransferResponse, "a transfer in acme")
            expect(transfer.state == TransferStateSchema.DONE, f"transfer state {transfer.state}")
            for account_id, expected in ((acme_a, 7_500), (acme_b, 2_500)):
                response = get_account.sync_detailed(client=as_acme, id=account_id)
                account = answer(response, HTTPStatus.OK, AccountResponse, f"GET {account_id}")
                expect(account.balance == expected, f"{account_id} after the transfer: {account}")

            # Another tenant's account does not exist for a tenant's key: not to read, not
            # to name in a transfer.
            response = get_account.sync_detailed(client=as_acme, id=globex_a)
            refused(response, HTTPStatus.NOT_FOUND, "account_not_found", "acme reading globex's")
            response = get_account.sync_detailed(client=as_globex, id=acme_a)
            refused(response, HTTPStatus.NOT_FOUND, "account_not_found", "globex reading acme's")
            response = create_transfer.sync_detailed(
                client=as_acme,
                body=CreateTransferRequest(source=acme_a, destination=globex_a, amount=100),
            )
            problem = refused(
                response,
                HTTPStatus.UNPROCESSABLE_ENTITY,
                "unknown_account",
                "a transfer to another tenant's account",
            )
            expect(problem.account == globex_a, f"the problem names the account: {problem}")
            # A tenant's listing holds its own accounts only.
            response = list_accounts.sync_detailed(client=as_acme, limit=100)
            page = answer(response, HTTPStatus.OK, AccountPage, "GET /accounts as acme")
            expect(
                [(a.id, a.tenant) for a in page.items] == [(acme_a, acme), (acme_b, acme)]
                and page.next_ is None,
                f"acme lists {[(a.id, a.tenant) for a in page.items]}",
            )
            # The platform sees every tenant's accounts, and what the refused transfer
            # left untouched.
            response = get_account.sync_detailed(client=platform, id=globex_a)
            account = answer(
                response, HTTPStatus.OK, AccountResponse, "the platform reading globex's"
            )
            expect(
                (account.tenant, account.balance) == (globex, 500),
                f"globex's account after acme's refused transfer: {account}",
            )

            # Listings of keys never carry a secret. The platform admin lists every key
            # made; a tenant's admin only its tenant's.
            made = [acme_rw, acme_admin, globex_rw, acme_ro]
            keys, bodies = all_keys(platform, "GET /api-keys as the platform")
            listed = {k.id: (k.tenant, k.role) for k in keys}
            expect(
                all(listed.get(k.id) == (k.tenant, k.role) for k in made),
                f"the platform's listing lacks a key made: {listed}",
            )
            keys, acme_bodies = all_keys(as_acme_admin, "GET /api-keys as acme's admin")
            expect(
                sorted(k.id for k in keys) == sorted(k.id for k in made if k.tenant == acme),
                f"acme's admin lists {[(k.id, k.tenant) for k in keys]}",
            )
            for key in keys:
                expect("key" not in key.additional_properties, f"a listed key has a secret: {key}")
            secrets = [k.key.encode() for k in made]
            expect(
                not any(s in body for s in secrets for body in bodies + acme_bodies),
                "a listing of keys carries a secret",
            )

            # Revoked, a key is refused at once by the instance that revoked it; another
            # tenant's key is not found for a tenant's admin.
            response = delete_api_key.sync_detailed(client=as_acme_admin, id=globex_rw.id)
            refused(response, HTTPStatus.NOT_FOUND, "api_key_not_found", "acme revoking globex's")
            response = delete_api_key.sync_detailed(client=as_acme_admin, id=acme_rw.id)
            expect(
                response.status_code == HTTPStatus.NO_CONTENT,
                f"DELETE /api-keys/{{id}}: {response.status_code} {response.content[:500]!r}",
            )
            response = get_account.sync_detailed(client=as_acme, id=acme_a)
            refused(response, HTTPStatus.UNAUTHORIZED, "unauthorized", "a revoked key")
            challenge = response.headers.get("www-authenticate", "")
            expect(challenge.split(" ")[0] == "Bearer", f"WWW-Authenticate: {challenge!r}")
            response = delete_api_key.sync_detailed(client=as_acme_admin, id=acme_rw.id)
            refused(response, HTTPStatus.NOT_FOUND, "api_key_not_found", "revoking it again")
            # The tenant's other keys still work.
            response = get_account.sync_detailed(client=as_acme_admin, id=acme_a)
            answer(response, HTTPStatus.OK, AccountResponse, "acme's admin after the revocation")

    print(
        f"client tenants test passed: keys for {acme} and {globex}, transfer {transfer.id} "
        f"within {acme}, the other tenant's account not found, key {acme_rw.id} revoked"
    )


def main() -> int:
    if len(sys.argv) != 3:
        print(f"usage: {sys.argv[0]} BASE_URL ADMIN_KEY", file=sys.stderr)
        return 2
    try:
        run(sys.argv[1].rstrip("/"), sys.argv[2])
    except Mismatch as mismatch:
        print(f"client tenants test FAILED: {mismatch}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
