// A complete program using the client library: npm run example
// (with a gateway running, and GATEWAY_API_KEY / GATEWAY_SIGNING_SECRET set to a test key).
import { APIError, Gateway } from 'chat-gateway/client';

const client = new Gateway({
  apiKey: process.env.GATEWAY_API_KEY!,
  signingSecret: process.env.GATEWAY_SIGNING_SECRET!,
  baseURL: process.env.GATEWAY_BASE_URL ?? 'http://localhost:8080',
});

// 1. Wait for the answer: a chat completion, unless it takes longer than the server's wait.
const answer = await client.chat.completions.create({
  model: 'test-model',
  messages: [{ role: 'user', content: 'Hello!' }],
  wait: true,
});
if (answer.object === 'chat.completion') {
  console.log('answered at once:', answer.choices[0]?.message.content);
} else {
  console.log('still running; look it up as', answer.id);
}

// 2. Queue a request, then come back for it: poll() returns once it is completed or failed.
const queued = await client.chat.completions.create({
  model: 'test-delay-1500',
  messages: [{ role: 'user', content: 'Take your time.' }],
});
console.log('queued as', queued.id, `(${queued.object})`);
const record = await client.requests.poll(queued.id);
if (record.status === 'completed') {
  console.log('completed after', record.attempts, 'attempt(s):', record.result.choices[0]?.message.content);
} else {
  console.log('failed:', record.last_error_code);
}

// 3. Errors are typed, and carry the error's type and code (docs/errors.md).
try {
  await client.requests.get('req_00000000000000000000');
} catch (error) {
  if (!(error instanceof APIError)) throw error;
  console.log('lookup of an unknown id:', error.status, error.type, error.code);
}
