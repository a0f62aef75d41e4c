/** The worker's message check: only calls of its methods, with the right arity and callbacks only where expected. */
import { describe, expect, it } from 'vitest';
import { checkWorkerMessage, WORKER_METHODS } from './protocol.ts';

const raw = (value: unknown) => ({ type: 'RAW', value });

describe('checkWorkerMessage', () => {
  it('accepts comlink calls of the API', () => {
    const { port1, port2 } = new MessageChannel();
    expect(checkWorkerMessage({ id: 'a', type: 'APPLY', path: ['stats'], argumentList: [] })).toBeNull();
    expect(
      checkWorkerMessage({ id: 'a', type: 'APPLY', path: ['chat'], argumentList: [raw({ messages: [] })] }),
    ).toBeNull();
    expect(
      checkWorkerMessage({
        id: 'a',
        type: 'APPLY',
        path: ['load'],
        argumentList: [raw('https://x/m.gguf'), raw({}), { type: 'HANDLER', name: 'proxy', value: port1 }],
      }),
    ).toBeNull();
    expect(checkWorkerMessage({ id: 'a', type: 'RELEASE', path: [] })).toBeNull();
    expect(WORKER_METHODS).toContain('subscribeStats');
    port1.close();
    port2.close();
  });

  it.each([
    [null, /not an object/],
    [{ type: 'APPLY', path: ['stats'], argumentList: [] }, /message id/],
    [{ id: 'a', type: 'GET', path: ['constructor'] }, /only method calls/],
    [{ id: 'a', type: 'SET', path: ['x'], value: raw(1) }, /only method calls/],
    [{ id: 'a', type: 'CONSTRUCT', path: [] }, /only method calls/],
    [{ id: 'a', type: 'APPLY', path: ['constructor'], argumentList: [] }, /unknown method/],
    [{ id: 'a', type: 'APPLY', path: ['__proto__'], argumentList: [] }, /unknown method/],
    [{ id: 'a', type: 'APPLY', path: ['chat', 'call'], argumentList: [] }, /unknown method/],
    [{ id: 'a', type: 'APPLY', path: ['stats'], argumentList: [raw(1)] }, /at most 0/],
    [{ id: 'a', type: 'APPLY', path: ['chat'], argumentList: 'x' }, /at most 1/],
    [{ id: 'a', type: 'APPLY', path: ['chat'], argumentList: [null] }, /malformed/],
    [
      { id: 'a', type: 'APPLY', path: ['chat'], argumentList: [{ type: 'HANDLER', name: 'throw', value: {} }] },
      /plain value/,
    ],
    [
      { id: 'a', type: 'APPLY', path: ['chat'], argumentList: [{ type: 'HANDLER', name: 'proxy', value: {} }] },
      /plain value/,
    ],
  ])('rejects %j', (message, reason) => {
    expect(checkWorkerMessage(message)).toMatch(reason);
  });

  it('accepts debug calls only in a debug worker, and only known actions', () => {
    const destroy = { id: 'a', type: 'APPLY', path: ['debug'], argumentList: [raw('destroyDevice')] };
    expect(checkWorkerMessage(destroy)).toMatch(/not started with debug/);
    expect(checkWorkerMessage(destroy, { debug: false })).toMatch(/not started with debug/);
    expect(checkWorkerMessage(destroy, { debug: true })).toBeNull();
    expect(checkWorkerMessage({ ...destroy, argumentList: [raw('destroyDevice'), raw(1)] }, { debug: true })).toMatch(
      /at most 1/,
    );
    expect(checkWorkerMessage({ ...destroy, argumentList: [raw('format')] }, { debug: true })).toMatch(
      /unknown debug action "format"/,
    );
    expect(checkWorkerMessage({ ...destroy, argumentList: [] }, { debug: true })).toMatch(/unknown debug action/);
    expect(
      checkWorkerMessage({ ...destroy, argumentList: [raw({ action: 'destroyDevice' })] }, { debug: true }),
    ).toMatch(/unknown debug action/);
    // Debug mode opens nothing else.
    expect(checkWorkerMessage({ id: 'a', type: 'GET', path: ['debug'] }, { debug: true })).toMatch(/only method calls/);
  });
});
