#!/usr/bin/env node
// The Plimsoll contract as a Node service sees it: @grpc/grpc-js and
// @grpc/proto-loader loading proto/plimsoll/v1/{inference,control}.proto at run
// time (no generated code), and protobufjs decoding the rich error model
// (google.rpc.Status in the grpc-status-details-bin trailer) from
// google/rpc/{status,error_details}.proto.
//
//   node contract.mjs <command> --address HOST:PORT --rpc-protos DIR [options]
//
// Commands (each prints JSON lines on stdout; tests/clients/test_node_contract.py
// asserts on them, so a failure names what Node saw):
//   reservations        Admit{reserve} eight times, the TTL clamp, client_request_id,
//                       redeeming and mismatching tickets; GetMemoryStatus after each
//   admit-generate      Admit then Generate for the same request (--hold starts a long
//                       stream first, to fill a server started with an in-flight limit)
//   errors              the error table: NOT_FOUND, BadRequest paths, MODEL_NOT_LOADED
//                       (--model-source: a model folder to LoadModel as a spare copy)
//   drain               two long streams; prints {"event":"streaming"} and then watches
//                       the drain the caller starts with SIGTERM: health, refusals, cuts
//
// --rpc-protos: the folder holding google/rpc/status.proto and error_details.proto
// (the googleapis-common-protos package files). Exit status: 0 once the command ran
// to the end (whatever the server answered), 1 for a usage or client error.

import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const here = path.dirname(fileURLToPath(import.meta.url));

function fail(message) {
  process.stderr.write(`${message}\n`);
  process.exit(1);
}

let parsed;
try {
  parsed = parseArgs({
    allowPositionals: true,
    options: {
      address: { type: 'string', default: '127.0.0.1:50051' },
      'proto-dir': { type: 'string', default: path.resolve(here, '../../../proto') },
      'rpc-protos': { type: 'string' },
      'model-source': { type: 'string', default: '' },
      hold: { type: 'boolean', default: false },
      'max-tokens': { type: 'string', default: '3500' },
    },
    strict: true,
  });
} catch (err) {
  fail(err.message);
}
const { values: args, positionals } = parsed;
if (positionals.length !== 1) fail('usage: contract.mjs <command> --address A --rpc-protos DIR');
if (!args['rpc-protos']) fail('--rpc-protos DIR is needed (google/rpc/*.proto)');

// -- the services, from the .proto files ---------------------------------------------
const LOADER = {
  keepCase: false, // camelCase fields, as JavaScript code expects
  longs: String, // uint64 byte counts as decimal strings
  enums: String, // ADMIT_VERDICT_WAIT rather than 3
  defaults: true,
  oneofs: true,
};
const definition = protoLoader.loadSync(
  ['plimsoll/v1/inference.proto', 'plimsoll/v1/control.proto', 'grpc/health/v1/health.proto'],
  { ...LOADER, includeDirs: [args['proto-dir'], path.join(here, 'protos')] },
);
const loaded = grpc.loadPackageDefinition(definition);
const plimsoll = loaded.plimsoll.v1;
const credentials = grpc.credentials.createInsecure();
const inference = new plimsoll.InferenceService(args.address, credentials);
const control = new plimsoll.ControlService(args.address, credentials);
const health = new loaded.grpc.health.v1.Health(args.address, credentials);

// -- the rich error model --------------------------------------------------------------
const rpcRoot = new protobuf.Root();
rpcRoot.resolvePath = (_origin, target) =>
  target.startsWith('google/rpc/') ? path.join(args['rpc-protos'], target) : target;
rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
const StatusType = rpcRoot.lookupType('google.rpc.Status');
const TO_OBJECT = { longs: String, enums: String, defaults: true };

const statusNames = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

// An error (or a stream's final status) as JSON: the code, the message and every
// google.rpc detail decoded, keyed by its type's short name ("ErrorInfo", ...).
function richStatus(status) {
  const out = {
    code: status.code,
    codeName: statusNames[status.code] ?? 'UNKNOWN',
    message: status.details,
    hasDetailsBin: false,
    detailTypes: [],
    details: {},
  };
  const bins = status.metadata?.get('grpc-status-details-bin') ?? [];
  if (bins.length === 0) return out;
  out.hasDetailsBin = true;
  const st = StatusType.decode(bins[0]);
  out.statusCode = st.code;
  out.statusMessage = st.message;
  for (const any of st.details) {
    // The bundled google/protobuf/any.proto keeps the field's case: type_url.
    const typeUrl = any.typeUrl ?? any.type_url ?? '';
    const typeName = typeUrl.slice(typeUrl.lastIndexOf('/') + 1);
    out.detailTypes.push(typeName);
    let decoded;
    try {
      const type = rpcRoot.lookupType(typeName);
      decoded = type.toObject(type.decode(any.value), TO_OBJECT);
    } catch (err) {
      decoded = { undecodable: String(err) };
    }
    out.details[typeName.slice(typeName.lastIndexOf('.') + 1)] = decoded;
  }
  return out;
}

// -- calls -------------------------------------------------------------------------------
const deadlineIn = (seconds) => new Date(Date.now() + seconds * 1000);

// A unary call: {ok: true, response} or {ok: false, status}.
function unary(client, method, request, timeoutS = 60) {
  return new Promise((resolve) => {
    client[method](request, { deadline: deadlineIn(timeoutS) }, (err, response) => {
      resolve(err ? { ok: false, status: richStatus(err) } : { ok: true, response });
    });
  });
}

// A Generate stream read to its end. `result.done` resolves once the final status
// is in; `onMessage(message, result)` sees each message as it arrives.
function stream(request, { timeoutS = 120, onMessage } = {}) {
  const call = inference.Generate(request, { deadline: deadlineIn(timeoutS) });
  const result = {
    call,
    messages: [],
    tokensReceived: 0,
    status: null,
    endedAt: null,
  };
  result.done = new Promise((resolve) => {
    call.on('data', (message) => {
      result.messages.push({ event: message.event, [message.event]: message[message.event] });
      if (message.event === 'chunk') result.tokensReceived += message.chunk.tokenIds.length;
      onMessage?.(message, result);
    });
    call.on('error', () => {}); // the final status comes with 'status' below
    call.on('status', (status) => {
      result.endedAt = Date.now();
      result.status = richStatus(status);
      setImmediate(resolve, result); // after any message still being delivered
    });
  });
  return result;
}

// What a stream looked like, without the bulk of its chunks.
function summary(result) {
  const events = result.messages.map((m) => m.event);
  const last = result.messages.at(-1);
  return {
    events: [...new Set(events)],
    firstEvent: events[0] ?? null,
    lastEvent: events.at(-1) ?? null,
    messageCount: events.length,
    endCount: events.filter((e) => e === 'end').length,
    start: result.messages.find((m) => m.event === 'start')?.start ?? null,
    end: last?.event === 'end' ? last.end : null,
    tokensReceived: result.tokensReceived,
    endedAt: result.endedAt,
    status: result.status,
  };
}

// The first answer of a Generate: a start message, a status, or nothing in
// `waitMs`. A started stream is cancelled.
function firstAnswer(request, waitMs = 20000) {
  return new Promise((resolve) => {
    let settled = false;
    const settle = (value) => {
      if (!settled) {
        settled = true;
        clearTimeout(timer);
        resolve(value);
      }
    };
    const call = inference.Generate(request, { deadline: deadlineIn(120) });
    const timer = setTimeout(() => {
      settle({ kind: 'waiting' });
      call.cancel();
    }, waitMs);
    call.on('data', (message) => {
      settle({ kind: message.event, [message.event]: message[message.event] });
      call.cancel();
    });
    call.on('error', () => {});
    call.on('status', (status) => settle({ kind: 'status', status: richStatus(status) }));
  });
}

function emit(object) {
  process.stdout.write(`${JSON.stringify(object)}\n`);
}

async function admission() {
  const r = await unary(control, 'GetMemoryStatus', {});
  return r.ok ? r.response.admission : { error: r.status };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// -- 1. reservations ---------------------------------------------------------------------
async function reservations() {
  const request = { text: 'a prompt a Node client reserves room for', maxTokens: 8, ignoreEos: true };
  const out = { request, baseline: await admission() };

  out.admits = [];
  for (let i = 0; i < 8; i += 1) {
    out.admits.push(await unary(control, 'Admit', { request, reserve: true }));
  }
  out.afterEight = await admission();

  const tenYears = 10 * 365 * 24 * 3600;
  out.askedTtlSeconds = tenYears;
  out.clampedAskedAt = Date.now();
  out.clamped = await unary(control, 'Admit', {
    request,
    reserve: true,
    reservationTtl: { seconds: String(tenYears), nanos: 0 },
  });
  out.afterClamped = await admission();

  // A retry with the same client_request_id while the ticket lives: the same ticket.
  const idem = { request, reserve: true, clientRequestId: 'node-contract-retry-1' };
  out.idempotent = [await unary(control, 'Admit', idem), await unary(control, 'Admit', idem)];
  out.afterIdempotent = await admission();

  // Another client, no ticket, while all of these are held.
  out.otherClient = summary(await stream({ text: 'another client entirely', maxTokens: 4 }).done);
  out.afterOtherClient = await admission();

  const tickets = out.admits.filter((a) => a.ok).map((a) => a.response.ticket);
  out.redeemed = summary(await stream({ ...request, admissionTicket: tickets[0] }).done);
  out.afterRedeem = await admission();

  out.mismatch = summary(await stream({
    ...request, text: 'not the prompt the ticket was issued for', admissionTicket: tickets[1],
  }).done);
  out.afterMismatch = await admission();
  // The mismatch released the ticket: it is gone even for its own request.
  out.reuseAfterMismatch = summary(await stream({ ...request, admissionTicket: tickets[1] }).done);

  // Leave the server as found: redeem everything still held.
  const rest = [...tickets.slice(2)];
  if (out.clamped.ok) rest.push(out.clamped.response.ticket);
  if (out.idempotent[0].ok) rest.push(out.idempotent[0].response.ticket);
  out.cleanup = [];
  for (const ticket of rest) {
    const s = summary(await stream({ ...request, admissionTicket: ticket }).done);
    out.cleanup.push({ ticket, lastEvent: s.lastEvent, status: s.status });
  }
  out.afterCleanup = await admission();
  emit(out);
}

// -- 2. Admit predicts Generate ----------------------------------------------------------
async function admitGenerate() {
  const request = { text: 'does Admit predict Generate', maxTokens: 4, ignoreEos: true };
  const out = { hold: args.hold };
  let held = null;
  if (args.hold) {
    let firstChunk;
    const gotChunk = new Promise((resolve) => { firstChunk = resolve; });
    held = stream(
      { text: 'a long stream that fills the in-flight limit', maxTokens: 3000, ignoreEos: true },
      { onMessage: (m) => { if (m.event === 'chunk') firstChunk(); } },
    );
    await Promise.race([gotChunk, held.done]);
    out.holdRunning = held.status === null;
    out.admissionWhileHeld = await admission();
  }
  out.admit = await unary(control, 'Admit', { request });
  out.generate = await firstAnswer(request);
  if (held !== null) {
    out.holdStillRunning = held.status === null;
    held.call.cancel();
    await held.done;
    // Once the held stream has left, the room is back: Admit and Generate agree again.
    let admit;
    for (let i = 0; i < 50; i += 1) {
      admit = await unary(control, 'Admit', { request });
      if (admit.ok && admit.response.verdict === 'ADMIT_VERDICT_ADMIT') break;
      await sleep(100);
    }
    out.admitAfterRelease = admit;
    out.generateAfterRelease = await firstAnswer(request);
  }
  emit(out);
}

// -- 4. the error table -------------------------------------------------------------------
async function errorTable() {
  const listed = await unary(control, 'ListModels', {});
  if (!listed.ok) fail(`ListModels failed: ${JSON.stringify(listed.status)}`);
  const model = listed.response.models.find((m) => m.isDefault) ?? listed.response.models[0];
  emit({ case: 'default-model', modelId: model.modelId, contextLength: model.contextLength });

  const generate = async (name, request) => {
    const s = summary(await stream(request, { timeoutS: 60 }).done);
    emit({ case: name, rpc: 'Generate', messages: s.messageCount, status: s.status });
  };
  const admit = async (name, request) => {
    const r = await unary(control, 'Admit', { request });
    emit({ case: name, rpc: 'Admit', ok: r.ok, status: r.ok ? null : r.status });
  };

  const unknown = { modelId: 'no-such-model-from-node', text: 'hello', maxTokens: 4 };
  await generate('unknown-model', unknown);
  await admit('unknown-model', unknown);

  const twoBad = { text: 'hello', maxTokens: model.contextLength + 16, sampling: { temperature: -1 } };
  await generate('two-bad-fields', twoBad);
  await admit('two-bad-fields', twoBad);
  const longOnly = { text: 'hello', maxTokens: model.contextLength + 16 };
  await generate('max-tokens-beyond-context', longOnly);
  await admit('max-tokens-beyond-context', longOnly);

  const spare = 'node-contract-spare';
  const load = await unary(control, 'LoadModel', { source: args['model-source'], modelId: spare }, 120);
  const unload = await unary(control, 'UnloadModel', { modelId: spare }, 60);
  emit({ case: 'spare-load-unload', load: load.ok ? load.response.model.state : load.status,
    unload: unload.ok ? 'ok' : unload.status });
  const unloaded = { modelId: spare, text: 'hello', maxTokens: 4 };
  await generate('unloaded-model', unloaded);
  await admit('unloaded-model', unloaded);
}

// -- 5. drain ----------------------------------------------------------------------------
async function healthOf(service) {
  const r = await unary(health, 'Check', { service }, 2);
  return r.ok ? r.response.status : `error ${r.status.codeName}: ${r.status.message}`;
}

async function drain() {
  const maxTokens = Number.parseInt(args['max-tokens'], 10);
  const streams = [];
  const started = [];
  for (let i = 0; i < 2; i += 1) {
    let firstChunk;
    started.push(new Promise((resolve) => { firstChunk = resolve; }));
    streams.push(stream(
      { text: `a long stream ${i} cut by the drain`, maxTokens, ignoreEos: true },
      { onMessage: (m) => { if (m.event === 'chunk') firstChunk(); } },
    ));
  }
  await Promise.race([Promise.all(started), ...streams.map((s) => s.done)]);
  const before = streams.map((s) => s.tokensReceived);
  emit({ event: 'streaming', tokensReceived: before, ended: streams.map((s) => s.status !== null) });

  // The caller sends SIGTERM now; probes see the drain through the open listener.
  const out = { event: 'drain' };
  const polls = [];
  const pollUntil = Date.now() + 10000;
  let seen = null;
  while (Date.now() < pollUntil) {
    seen = await healthOf('');
    polls.push(seen);
    if (seen === 'NOT_SERVING') break;
    await sleep(20);
  }
  out.notServingAt = seen === 'NOT_SERVING' ? Date.now() : null;
  out.healthPolls = [...new Set(polls)];
  out.health = {};
  for (const service of ['', 'plimsoll.v1.InferenceService', 'plimsoll.v1.ControlService']) {
    out.health[service] = await healthOf(service);
  }
  const listed = await unary(health, 'List', {}, 2);
  out.healthList = listed.ok
    ? Object.fromEntries(Object.entries(listed.response.statuses).map(([k, v]) => [k, v.status]))
    : listed.status;
  out.memoryStatus = await admission();
  const late = { text: 'a request that arrives during the drain', maxTokens: 4 };
  out.lateGenerate = summary(await stream(late, { timeoutS: 10 }).done);
  const lateAdmit = await unary(control, 'Admit', { request: late }, 10);
  out.lateAdmit = lateAdmit.ok ? { ok: true, response: lateAdmit.response } : lateAdmit;
  out.checksDoneAt = Date.now();
  out.streamsRunningAfterChecks = streams.map((s) => s.status === null);

  await Promise.all(streams.map((s) => s.done));
  out.streams = streams.map((s, i) => ({ ...summary(s), tokensBeforeSignal: before[i] }));
  emit(out);
}

const commands = {
  reservations,
  'admit-generate': admitGenerate,
  errors: errorTable,
  drain,
};
const command = commands[positionals[0]];
if (command === undefined) fail(`unknown command ${positionals[0]}; one of ${Object.keys(commands)}`);
try {
  await command();
} catch (err) {
  fail(`contract.mjs ${positionals[0]}: ${err.stack ?? err}`);
} finally {
  for (const client of [inference, control, health]) client.close();
}
