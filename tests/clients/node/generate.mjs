#!/usr/bin/env node
// A Plimsoll client as a Node service would write it: @grpc/grpc-js plus
// @grpc/proto-loader reading proto/plimsoll/v1/inference.proto at run time
// (no generated code). Calls InferenceService.Generate and prints every stream
// message as one JSON line on stdout.
//
//   node generate.mjs --address 127.0.0.1:50051 --text hello --max-tokens 8 [--model ID]
//
// Exit status: 0 when the stream ends normally; 2 when it ends with a gRPC
// status (printed as one JSON line on stderr: code, codeName, details); 1 for
// a usage error.

import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const here = path.dirname(fileURLToPath(import.meta.url));

function usage(message) {
  process.stderr.write(`${message}\n`);
  process.exit(1);
}

let args;
try {
  ({ values: args } = parseArgs({
    options: {
      address: { type: 'string', default: '127.0.0.1:50051' },
      'proto-dir': { type: 'string', default: path.resolve(here, '../../../proto') },
      model: { type: 'string', default: '' },
      text: { type: 'string', default: 'hello' },
      'max-tokens': { type: 'string', default: '16' },
      'ignore-eos': { type: 'boolean', default: true },
      'no-ignore-eos': { type: 'boolean', default: false },
      'deadline-s': { type: 'string', default: '120' },
    },
    strict: true,
  }));
} catch (err) {
  usage(err.message);
}

const maxTokens = Number.parseInt(args['max-tokens'], 10);
if (!Number.isInteger(maxTokens) || maxTokens < 0) usage('--max-tokens must be an integer >= 0');

const definition = protoLoader.loadSync('plimsoll/v1/inference.proto', {
  includeDirs: [args['proto-dir']],
  keepCase: false, // camelCase fields, as JavaScript code expects
  longs: String,
  enums: String, // FINISH_REASON_LENGTH rather than 2
  defaults: true,
  oneofs: true, // adds `event: 'start' | 'chunk' | 'end'`
});
const plimsoll = grpc.loadPackageDefinition(definition).plimsoll.v1;
const client = new plimsoll.InferenceService(args.address, grpc.credentials.createInsecure());

const statusNames = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

const request = {
  modelId: args.model,
  text: args.text,
  maxTokens,
  ignoreEos: args['ignore-eos'] && !args['no-ignore-eos'],
};
const deadline = new Date(Date.now() + Number(args['deadline-s']) * 1000);
const call = client.Generate(request, { deadline });

call.on('data', (message) => {
  // Only the member of the oneof that is set, plus the `event` discriminator.
  const out = { event: message.event, [message.event]: message[message.event] };
  process.stdout.write(`${JSON.stringify(out)}\n`);
});
call.on('error', (err) => {
  const status = { code: err.code, codeName: statusNames[err.code] ?? 'UNKNOWN', details: err.details };
  process.stderr.write(`${JSON.stringify(status)}\n`);
  client.close();
  process.exitCode = 2;
});
call.on('end', () => {
  client.close();
});
