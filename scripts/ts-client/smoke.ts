// Tenants and API keys through a TypeScript client typed from openapi/openapi.json
// (openapi-typescript's schema.d.ts, openapi-fetch), against a running service configured
// with `API_KEYS=admin:<key>` (docs/tenants.md). The types come from the document: a call,
// a field or a status this file uses that the document does not describe fails `tsc`.
//
// scripts/check-api.sh generates schema.d.ts next to this file, compiles it and runs
//
//     node out/smoke.js http://127.0.0.1:<port> <admin key>
//
// Any answer other than the one expected stops it with a non-zero exit status.

import createClient from "openapi-fetch";
import type { components, paths } from "./schema.js";

// Node's own, declared here rather than through @types/node: all this file uses of it.
declare const process: { argv: string[]; exitCode?: number };

type AccountResponse = components["schemas"]["AccountResponse"];
type ApiKeyResponse = components["schemas"]["ApiKeyResponse"];
type ApiKeyPage = components["schemas"]["ApiKeyPage"];
type Problem = components["schemas"]["Problem"];

// The listed key's type has no secret: this line does not compile if the document gives
// ApiKeyResponse a `key`.
const listingHasNoSecret: "key" extends keyof ApiKeyResponse ? never : true = true;

class Mismatch extends Error {}

function expect(condition: boolean, what: string): asserts condition {
  if (!condition) throw new Mismatch(what);
}

// The body of an answer that must have this status.
function answer<T>(got: { data?: T; response: Response }, status: number, what: string): T {
  expect(
    got.response.status === status && got.data !== undefined,
    `${what}: expected ${status}, got ${got.response.status}`,
  );
  return got.data;
}

// The problem of an answer that must have this status and code.
function refused(
  got: { error?: Problem; response: Response },
  status: number,
  code: string,
  what: string,
): Problem {
  const problem = got.error;
  expect(
    got.response.status === status &&
      got.response.headers.get("content-type") === "application/problem+json" &&
      problem?.status === status &&
      problem.code === code,
    `${what}: expected ${status} ${code}, got ${got.response.status} ${JSON.stringify(problem)}`,
  );
  return problem;
}

function client(baseUrl: string, key: string) {
  return createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${key}` } });
}

async function run(baseUrl: string, adminKey: string): Promise<string> {
  const runId = Math.random().toString(16).slice(2, 14);
  const tenant = `ts-${runId}`;
  const other = `ts-other-${runId}`;
  const platform = client(baseUrl, adminKey);

  // A key of the tenant, made by the platform admin key; its secret is shown this once.
  const made = answer(
    await platform.POST("/api-keys", { body: { tenant, role: "rw" } }),
    201,
    "POST /api-keys",
  );
  expect(
    made.tenant === tenant && made.role === "rw" && made.key.startsWith("tsk_"),
    `the key made is ${JSON.stringify({ ...made, key: "..." })}`,
  );
  const asTenant = client(baseUrl, made.key);

  // An account opened with the tenant's key is the tenant's.
  const accountId = `${tenant}-a`;
  const opened: AccountResponse = answer(
    await asTenant.POST("/accounts", { body: { id: accountId, balance: 1_000, currency: "EUR" } }),
    201,
    "POST /accounts",
  );
  expect(opened.tenant === tenant, `the account opened is ${JSON.stringify(opened)}`);
  const read = answer(
    await asTenant.GET("/accounts/{id}", { params: { path: { id: accountId } } }),
    200,
    "GET /accounts/{id}",
  );
  expect(
    read.id === accountId && read.tenant === tenant && read.balance === 1_000,
    `the account read is ${JSON.stringify(read)}`,
  );

  // Another tenant's account (opened by the platform key, naming that tenant) does not
  // exist for the tenant's key.
  const otherId = `${other}-a`;
  answer(
    await platform.POST("/accounts", { body: { id: otherId, currency: "EUR", tenant: other } }),
    201,
    "POST /accounts for another tenant",
  );
  refused(
    await asTenant.GET("/accounts/{id}", { params: { path: { id: otherId } } }),
    404,
    "account_not_found",
    "another tenant's account",
  );

  // The listing of keys carries no secret.
  const page = answer(
    await platform.GET("/api-keys", { params: { query: { limit: 100 } } }),
    200,
    "GET /api-keys",
  );
  const listed: ApiKeyResponse[] = page.items;
  expect(
    !JSON.stringify(page).includes(made.key) && listed.every((k) => !("key" in k)),
    "a listing of keys carries a secret",
  );
  // Page by page, one key a page: each page's `next`, passed as `after`, gives the
  // next one (the one form every listing pages in; tsc checks the types line up).
  const walked: string[] = [];
  let after: string | undefined = undefined;
  for (let n = 0; n <= listed.length; n++) {
    const one: ApiKeyPage = answer(
      await platform.GET("/api-keys", { params: { query: { limit: 1, after } } }),
      200,
      "GET /api-keys page by page",
    );
    walked.push(...one.items.map((k) => k.id));
    if (one.next === null) break;
    after = one.next;
  }
  expect(
    JSON.stringify(walked) === JSON.stringify(listed.map((k) => k.id)),
    `the keys page by page (${walked}) are not the listing (${listed.map((k) => k.id)})`,
  );

  // Revoked, the key is refused.
  const revoked = await platform.DELETE("/api-keys/{id}", { params: { path: { id: made.id } } });
  expect(revoked.response.status === 204, `DELETE /api-keys/{id}: ${revoked.response.status}`);
  refused(
    await asTenant.GET("/accounts/{id}", { params: { path: { id: accountId } } }),
    401,
    "unauthorized",
    "a revoked key",
  );
  return `key ${made.id} of ${tenant}, account ${accountId}, ${otherId} not found, key revoked`;
}

const [baseUrl, adminKey] = process.argv.slice(2);
if (baseUrl === undefined || adminKey === undefined || !listingHasNoSecret) {
  console.error("usage: node out/smoke.js BASE_URL ADMIN_KEY");
  process.exitCode = 2;
} else {
  try {
    const walked = await run(baseUrl.replace(/\/$/, ""), adminKey);
    console.log(`typescript client smoke test passed: ${walked}`);
  } catch (error) {
    const what = error instanceof Mismatch ? error.message : error;
    console.error(`typescript client smoke test FAILED: ${what}`);
    process.exitCode = 1;
  }
}
