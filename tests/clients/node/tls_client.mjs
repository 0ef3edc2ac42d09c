#!/usr/bin/env node
// A Node service reaching a Plimsoll server that serves mutual TLS and bearer tokens:
// @grpc/grpc-js with grpc.credentials.createSsl(ca, key, cert), the token as
// `authorization: Bearer` call metadata, proto/ loaded at run time. Calls
// ControlService.GetMemoryStatus, then InferenceService.Generate, and prints one JSON
// line for each answer on stdout.
//
//   node tls_client.mjs --address 127.0.0.1:50051 --ca ca.crt [--cert c.crt --key c.key]
//                       [--token TOKEN]
//
// Exit status: 0 when both calls succeed; 2 when one fails (its status as one JSON line
// on stderr: code, codeName, details); 1 for a usage error.

import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const here = path.dirname(fileURLToPath(import.meta.url));

let args;
try {
  ({ values: args } = parseArgs({
    options: {
      address: { type: 'string', default: '127.0.0.1:50051' },
      'proto-dir': { type: 'string', default: path.resolve(here, '../../../proto') },
      ca: { type: 'string' },
      cert: { type: 'string' },
      key: { type: 'string' },
      token: { type: 'string', default: '' },
      'deadline-s': { type: 'string', default: '30' },
    },
    strict: true,
  }));
} catch (err) {
  process.stderr.write(`${err.message}\n`);
  process.exit(1);
}
if (!args.ca || Boolean(args.cert) !== Boolean(args.key)) {
  process.stderr.write('--ca is required; --cert and --key go together\n');
  process.exit(1);
}

const definition = protoLoader.loadSync(
  ['plimsoll/v1/inference.proto', 'plimsoll/v1/control.proto'],
  { includeDirs: [args['proto-dir']], longs: String, enums: String, defaults: true, oneofs: true },
);
const plimsoll = grpc.loadPackageDefinition(definition).plimsoll.v1;

const read = (p) => (p ? fs.readFileSync(p) : null);
const credentials = grpc.credentials.createSsl(read(args.ca), read(args.key), read(args.cert));
const control = new plimsoll.ControlService(args.address, credentials);
const inference = new plimsoll.InferenceService(args.address, credentials);

const metadata = new grpc.Metadata();
if (args.token) metadata.set('authorization', `Bearer ${args.token}`);
const deadline = () => new Date(Date.now() + Number(args['deadline-s']) * 1000);
const statusNames = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

function failed(err) {
  const status = { code: err.code, codeName: statusNames[err.code] ?? 'UNKNOWN', details: err.details };
  process.stderr.write(`${JSON.stringify(status)}\n`);
  control.close();
  inference.close();
  process.exit(2);
}

const memory = await new Promise((resolve) => {
  control.GetMemoryStatus({}, metadata, { deadline: deadline() }, (err, reply) => {
    if (err) failed(err);
    resolve(reply);
  });
});
process.stdout.write(`${JSON.stringify({ call: 'GetMemoryStatus', level: memory.level })}\n`);

const events = await new Promise((resolve) => {
  const seen = [];
  const call = inference.Generate(
    { text: 'hello over mutual TLS', maxTokens: 4, ignoreEos: true },
    metadata,
    { deadline: deadline() },
  );
  call.on('data', (message) => seen.push(message.event));
  call.on('error', failed);
  call.on('end', () => resolve(seen));
});
process.stdout.write(`${JSON.stringify({ call: 'Generate', events })}\n`);
control.close();
inference.close();
