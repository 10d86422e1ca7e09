#!/usr/bin/env python3
"""Moves money with a Python client generated from openapi/openapi.json, against a running
service: the document must describe the API well enough for a generated client to use it.

scripts/check-api.sh generates the client (package `transfer_service_client`) and runs

    python scripts/client_smoke.py http://127.0.0.1:<port>

Any answer other than the one expected stops it with a non-zero exit status. The client
raises on a status the document does not declare for the operation.
"""

from __future__ import annotations

import sys
import uuid
from http import HTTPStatus

from transfer_service_client import Client
from transfer_service_client.api.accounts import (
    create_account,
    get_account,
    get_balance,
    list_entries,
)
from transfer_service_client.api.transfers import (
    cancel_transfer,
    create_transfer,
    get_transfer,
)
from transfer_service_client.models import (
    AccountResponse,
    BalanceResponse,
    CancelReasonSchema,
    CreateAccountRequest,
    CreateTransferRequest,
    EntryKindSchema,
    EntryPage,
    Problem,
    TransferResponse,
    TransferStateSchema,
)
from transfer_service_client.types import Response


class Mismatch(Exception):
    """The service answered otherwise than the document and docs/api.md promise."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Mismatch(what)


def answer(response: Response, status: HTTPStatus, kind: type, what: str):
    """The parsed body of `response`, which must have this status and body type."""
    expect(
        response.status_code == status and isinstance(response.parsed, kind),
        f"{what}: expected {status.value} with a {kind.__name__}, got "
        f"{response.status_code.value} {response.content[:500]!r}",
    )
    return response.parsed


def balance(client: Client, account_id: str) -> int:
    response = get_account.sync_detailed(client=client, id=account_id)
    return answer(response, HTTPStatus.OK, AccountResponse, f"GET /accounts/{account_id}").balance


def run(base_url: str) -> None:
    run_id = uuid.uuid4().hex[:12]
    alice, bob = f"smoke-{run_id}-alice", f"smoke-{run_id}-bob"

    with Client(base_url=base_url, raise_on_unexpected_status=True, timeout=30.0) as client:
        # Two accounts in the same currency.
        for account_id, name, opening in ((alice, "Alice", 10_000), (bob, None, 0)):
            body = CreateAccountRequest(id=account_id, balance=opening, currency="EUR")
            if name is not None:
                body.name = name
            response = create_account.sync_detailed(client=client, body=body)
            account = answer(response, HTTPStatus.CREATED, AccountResponse, "POST /accounts")
            expect(
                (account.id, account.balance, account.currency, account.name)
                == (account_id, opening, "EUR", name),
                f"the opened account is {account}",
            )
            expect(
                response.headers.get("location") == f"/accounts/{account_id}",
                f"Location of the new account: {response.headers.get('location')!r}",
            )

        # A transfer runs to `done` and answers 201.
        key = f"smoke-{run_id}"
        transfer_body = CreateTransferRequest(
            source=alice, destination=bob, amount=2_500, reference="client smoke test"
        )
        response = create_transfer.sync_detailed(
            client=client, body=transfer_body, idempotency_key=key
        )
        transfer = answer(response, HTTPStatus.CREATED, TransferResponse, "POST /transfers")
        expect(transfer.state == TransferStateSchema.DONE, f"transfer state {transfer.state}")
        expect(
            (transfer.source, transfer.destination, transfer.amount, transfer.currency)
            == (alice, bob, 2_500, "EUR"),
            f"the transfer is {transfer}",
        )
        expect(
            response.headers.get("location") == f"/transfers/{transfer.id}",
            f"Location of the transfer: {response.headers.get('location')!r}",
        )

        # The same request with the same key is answered with the same transfer.
        response = create_transfer.sync_detailed(
            client=client, body=transfer_body, idempotency_key=key
        )
        replay = answer(response, HTTPStatus.CREATED, TransferResponse, "the retried POST /transfers")
        expect(replay.id == transfer.id, f"a retry made another transfer: {replay.id}")
        expect(
            response.headers.get("idempotent-replayed") == "true",
            "a retry answers with Idempotent-Replayed: true",
        )

        # Read back: the transfer, and the balances it moved (once).
        response = get_transfer.sync_detailed(client=client, id=transfer.id)
        stored = answer(response, HTTPStatus.OK, TransferResponse, "GET /transfers/{id}")
        expect(
            stored.id == transfer.id and stored.state == TransferStateSchema.DONE,
            f"the stored transfer is {stored}",
        )
        expect(stored.reference == "client smoke test", f"reference {stored.reference!r}")
        expect(balance(client, alice) == 7_500, "alice's balance after the transfer")
        expect(balance(client, bob) == 2_500, "bob's balance after the transfer")

        # Cancelling a done transfer reverses it with a compensating transfer.
        response = cancel_transfer.sync_detailed(client=client, id=transfer.id)
        canceled = answer(response, HTTPStatus.OK, TransferResponse, "POST /transfers/{id}/cancel")
        expect(
            canceled.state == TransferStateSchema.DONE and isinstance(canceled.reversed_by, str),
            f"a canceled done transfer is done with reversedBy: {canceled}",
        )
        response = get_transfer.sync_detailed(client=client, id=canceled.reversed_by)
        reversal = answer(response, HTTPStatus.OK, TransferResponse, "GET the reversal")
        expect(
            (reversal.reverses, reversal.source, reversal.destination, reversal.amount, reversal.state)
            == (transfer.id, bob, alice, 2_500, TransferStateSchema.DONE),
            f"the reversal is {reversal}",
        )
        expect(balance(client, alice) == 10_000, "alice's balance after the reversal")
        expect(balance(client, bob) == 0, "bob's balance after the reversal")

        # A transfer the source cannot fund: recorded, canceled, and answered 422.
        response = create_transfer.sync_detailed(
            client=client,
            body=CreateTransferRequest(source=bob, destination=alice, amount=1),
        )
        problem = answer(response, HTTPStatus.UNPROCESSABLE_ENTITY, Problem, "an unfunded transfer")
        expect(problem.code == "insufficient_funds", f"problem code {problem.code!r}")
        expect(problem.status == 422, f"problem status {problem.status}")
        expect(
            isinstance(problem.transfer_id, str),
            f"the problem names the recorded transfer: {problem}",
        )
        response = get_transfer.sync_detailed(client=client, id=problem.transfer_id)
        refused = answer(response, HTTPStatus.OK, TransferResponse, "GET the refused transfer")
        expect(
            refused.state == TransferStateSchema.CANCELED
            and refused.reason == CancelReasonSchema.INSUFFICIENT_FUNDS,
            f"the refused transfer is {refused}",
        )
        expect(balance(client, bob) == 0, "bob's balance after the refused transfer")

        # Alice's ledger: her opening, the transfer's debit, the reversal's credit; the
        # refused transfer moved nothing and made no entry.
        response = list_entries.sync_detailed(client=client, id=alice, limit=1000)
        page = answer(response, HTTPStatus.OK, EntryPage, "GET /accounts/{id}/entries")
        expect(
            [(e.seq, e.kind, e.balance_change, e.balance) for e in page.items]
            == [
                (1, EntryKindSchema.OPENED, 10_000, 10_000),
                (2, EntryKindSchema.DEBIT, -2_500, 7_500),
                (3, EntryKindSchema.CREDIT, 2_500, 10_000),
            ]
            and page.next_ == "3",
            f"alice's entries are {page}",
        )
        expect(
            page.items[1].transfer_id == transfer.id
            and page.items[2].transfer_id == canceled.reversed_by,
            f"alice's entries name their transfers: {page}",
        )
        response = list_entries.sync_detailed(client=client, id=alice, after=page.next_)
        page = answer(response, HTTPStatus.OK, EntryPage, "GET entries after the last")
        expect(page.items == [] and page.next_ is None, f"nothing after the last: {page}")
        # As of the debit: the amounts it left (the last entry at or before its time).
        response = list_entries.sync_detailed(client=client, id=alice, limit=3)
        entries = answer(response, HTTPStatus.OK, EntryPage, "GET alice's entries").items
        last_by_then = [e for e in entries if e.at <= entries[1].at][-1]
        response = get_balance.sync_detailed(client=client, id=alice, at=entries[1].at)
        as_of = answer(response, HTTPStatus.OK, BalanceResponse, "GET /accounts/{id}/balance")
        expect(
            (as_of.seq, as_of.balance, as_of.available_balance)
            == (last_by_then.seq, last_by_then.balance, last_by_then.available_balance),
            f"alice as of her debit: {as_of}, expected the amounts of {last_by_then}",
        )

    print(
        f"client smoke test passed: opened {alice} and {bob}, transfer {transfer.id} done, "
        f"reversed by {canceled.reversed_by}, refused transfer {problem.transfer_id}"
    )


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BASE_URL", file=sys.stderr)
        return 2
    try:
        run(sys.argv[1].rstrip("/"))
    except Mismatch as mismatch:
        print(f"client smoke test FAILED: {mismatch}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
