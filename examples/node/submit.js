#!/usr/bin/env node
// Submits files to a HarmonicIO gateway's ingest API (hio.proto.Ingest) and waits until each
// is stored: a client written from proto/ and docs/ingest.md alone.
//
//   node submit.js --image hio/microscopy [--address HOST:PORT] [--token-file FILE] [--ca FILE]
//                  [--wait-seconds N] FILE...
//
// Prints the gateway's limits, then one line per file: "NAME: STORED tuple ID", or how else it
// ended. Exit 0 when every file was STORED or ENQUEUED, 1 otherwise, 2 for bad arguments.
// --wait-seconds (default 600) bounds the whole call: a file whose image no engine serves has
// no outcome until one does; the files the gateway ACCEPTED stay in its spool all the same.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const zlib = require('node:zlib');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// The contract: the .proto files of the repository, loaded as they are (no generated code).
const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const USAGE =
  'usage: node submit.js --image IMAGE [--address HOST:PORT] [--token-file FILE] [--ca FILE] [--wait-seconds N] FILE...';

function parseArgs(argv) {
  const options = {
    address: process.env.HIO_GATEWAY_INGEST_LISTEN || '127.0.0.1:7300',
    image: '',
    tokenFile: '',
    ca: '',
    waitSeconds: '600',
    files: [],
  };
  const flags = {
    '--address': 'address',
    '--image': 'image',
    '--token-file': 'tokenFile',
    '--ca': 'ca',
    '--wait-seconds': 'waitSeconds',
  };
  for (let i = 0; i < argv.length; i += 1) {
    const name = flags[argv[i]];
    if (name !== undefined) {
      if (i + 1 >= argv.length) throw new Error(`${argv[i]} needs a value`);
      options[name] = argv[(i += 1)];
    } else if (argv[i].startsWith('--')) {
      throw new Error(`unknown option ${argv[i]}`);
    } else {
      options.files.push(argv[i]);
    }
  }
  if (!options.image) throw new Error('--image is required (the engine image, e.g. hio/microscopy)');
  if (options.files.length === 0) throw new Error('name at least one FILE');
  options.waitSeconds = Number(options.waitSeconds);
  if (!(options.waitSeconds > 0)) throw new Error('--wait-seconds must be a number of seconds above 0');
  return options;
}

function ingestClient(options) {
  const definition = protoLoader.loadSync('hio/proto/ingest.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: tuple_id, chunk_bytes
    longs: String, // uint64 tuple ids do not fit a JavaScript number
    enums: String, // receipt states by name: 'STORED'
    defaults: true,
  });
  const { Ingest } = grpc.loadPackageDefinition(definition).hio.proto;
  const credentials = options.ca
    ? grpc.credentials.createSsl(fs.readFileSync(options.ca))
    : grpc.credentials.createInsecure();
  return new Ingest(options.address, credentials);
}

// The token, sent on every call as the metadata header "authorization: Bearer <token>".
function callMetadata(options) {
  const metadata = new grpc.Metadata();
  const token = options.tokenFile ? fs.readFileSync(options.tokenFile, 'utf8').trim() : process.env.HIO_TOKEN || '';
  if (token) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

function gatewayStatus(client, metadata) {
  return new Promise((resolve, reject) => {
    client.GetGatewayStatus({}, metadata, { deadline: Date.now() + 10_000 }, (error, status) =>
      error ? reject(error) : resolve(status),
    );
  });
}

// One tuple as frames: metadata first, then chunks of at most chunkBytes, the last one marked.
function* tupleFrames(file, data, image, chunkBytes) {
  const meta = {
    image,
    name: path.basename(file),
    size: data.length,
    crc32: zlib.crc32(data), // CRC-32, zlib's polynomial, of the whole payload
    attributes: { 'hio.wait': 'stored' }, // answer with the outcome, not only ACCEPTED
  };
  const chunks = Math.max(1, Math.ceil(data.length / chunkBytes));
  for (let n = 0; n < chunks; n += 1) {
    const frame = { data: data.subarray(n * chunkBytes, (n + 1) * chunkBytes), last: n === chunks - 1 };
    if (n === 0) frame.meta = meta;
    yield frame;
  }
}

// Streams every file on one Submit call; resolves with the final receipt of each, by index,
// and whether --wait-seconds ended the call first.
function submit(client, metadata, options, limits) {
  return new Promise((resolve, reject) => {
    const finals = new Map();
    const accepted = new Set();
    const call = client.Submit(metadata, { deadline: Date.now() + options.waitSeconds * 1000 });
    call.on('data', (receipt) => {
      if (receipt.state === 'ACCEPTED') accepted.add(receipt.index);
      else finals.set(receipt.index, receipt);
    });
    call.on('error', (error) =>
      error.code === grpc.status.DEADLINE_EXCEEDED ? resolve({ finals, accepted, timedOut: true }) : reject(error),
    );
    call.on('end', () => resolve({ finals, accepted, timedOut: false }));
    (async () => {
      for (const file of options.files) {
        const data = fs.readFileSync(file);
        if (data.length > Number(limits.max_tuple_bytes)) {
          throw new Error(`${file}: ${data.length} bytes is over the gateway's max_tuple_bytes`);
        }
        for (const frame of tupleFrames(file, data, options.image, Number(limits.chunk_bytes))) {
          if (!call.write(frame)) await new Promise((drained) => call.once('drain', drained));
        }
      }
      call.end();
    })().catch((error) => {
      call.cancel();
      reject(error);
    });
  });
}

function describe(name, receipt, accepted, waitSeconds) {
  if (receipt === undefined && accepted) {
    return [`${name}: ACCEPTED, no outcome within --wait-seconds ${waitSeconds} (kept in the gateway's spool)`, false];
  }
  if (receipt === undefined) return [`${name}: no final receipt`, false];
  switch (receipt.state) {
    case 'STORED':
      return [`${name}: STORED tuple ${receipt.tuple_id}`, true];
    case 'ENQUEUED': {
      const why = receipt.message ? `: ${receipt.message}` : '';
      return [`${name}: ENQUEUED (${receipt.queued}) tuple ${receipt.tuple_id}${why}`, receipt.queued !== 'DEAD_LETTER'];
    }
    default:
      return [`${name}: ${receipt.state}: ${receipt.message}`, false];
  }
}

async function main() {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (error) {
    console.error(`submit.js: ${error.message}\n${USAGE}`);
    return 2;
  }
  const client = ingestClient(options);
  const metadata = callMetadata(options);
  try {
    const limits = await gatewayStatus(client, metadata);
    console.log(`gateway ${options.address}: chunk_bytes ${limits.chunk_bytes}, max_tuple_bytes ${limits.max_tuple_bytes}`);
    const { finals, accepted, timedOut } = await submit(client, metadata, options, limits);
    let ok = true;
    options.files.forEach((file, index) => {
      const [line, good] = describe(path.basename(file), finals.get(index), accepted.has(index), options.waitSeconds);
      console.log(line);
      ok = ok && good;
    });
    if (timedOut) {
      const status = await gatewayStatus(client, metadata).catch(() => ({ warnings: [] }));
      for (const warning of status.warnings) console.error(`submit.js: the gateway says: ${warning}`);
    }
    return ok ? 0 : 1;
  } catch (error) {
    const code = error.code === undefined ? '' : `${grpc.status[error.code]}: `;
    console.error(`submit.js: ${code}${error.details || error.message}`);
    return 1;
  } finally {
    client.close();
  }
}

main().then((code) => {
  process.exitCode = code;
});
