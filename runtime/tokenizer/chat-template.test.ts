import { Template } from '@huggingface/jinja';
import { describe, expect, it } from 'vitest';
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import { describeError, describeRefusal, faultLog, isRefusal } from '../../test/regressions/fault-log.ts';
import { bpeTokenizerMetadata } from '../../tools/fixtures/tokenizer-fixtures.ts';
import {
  CHAT_TEMPLATE_LIMITS,
  type ChatMessage,
  chatTemplateFromMetadata,
  FALLBACK_CHAT_TEMPLATE,
  probeChatTemplate,
  renderChatTemplate,
} from './chat-template.ts';
import { GgufTokenizer } from './tokenizer.ts';

const conversation: ChatMessage[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Hi there' },
  { role: 'assistant', content: 'Hello.' },
  { role: 'user', content: 'What is 2+2?' },
];

const log = faultLog('templates');

function metadataOf(name: 'llama3' | 'qwen3'): GgufMetadata {
  return Object.fromEntries(bpeTokenizerMetadata(name).map((e) => [e.key, e.value]));
}

describe('chat templates', () => {
  it('renders the ChatML fallback for a model without a template', () => {
    const template = chatTemplateFromMetadata({ 'tokenizer.ggml.model': 'llama' });
    expect(template).toBe(FALLBACK_CHAT_TEMPLATE);
    expect(renderChatTemplate(template, { messages: conversation.slice(0, 2) })).toBe(
      '<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n',
    );
    expect(renderChatTemplate(template, { messages: conversation.slice(1, 2), add_generation_prompt: false })).toBe(
      '<|im_start|>user\nHi there<|im_end|>\n',
    );
  });

  it("renders Llama 3's template from the GGUF metadata", () => {
    const meta = metadataOf('llama3');
    const text = renderChatTemplate(chatTemplateFromMetadata(meta), {
      messages: conversation.slice(0, 2),
      bos_token: '<|begin_of_text|>',
    });
    expect(text).toBe(
      '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>' +
        '<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>' +
        '<|start_header_id|>assistant<|end_header_id|>\n\n',
    );
    // The rendered prompt tokenizes with its markers as single control tokens (BOS comes from the template).
    const tokenizer = GgufTokenizer.fromMetadata(meta);
    const ids = tokenizer.encode(text, { addSpecial: false, parseSpecial: true });
    expect(ids[0]).toBe(tokenizer.bosId);
    expect(ids.filter((id) => id === tokenizer.eotId)).toHaveLength(2);
    expect(tokenizer.decode(ids, { skipSpecial: false })).toBe(text);
  });

  it("renders Qwen 3's template (namespace, reversed loops, generation prompt)", () => {
    const meta = metadataOf('qwen3');
    const text = renderChatTemplate(chatTemplateFromMetadata(meta), { messages: conversation });
    expect(text).toBe(
      '<|im_start|>system\nYou are terse.<|im_end|>\n' +
        '<|im_start|>user\nHi there<|im_end|>\n' +
        '<|im_start|>assistant\nHello.<|im_end|>\n' +
        '<|im_start|>user\nWhat is 2+2?<|im_end|>\n' +
        '<|im_start|>assistant\n',
    );
    const tokenizer = GgufTokenizer.fromMetadata(meta);
    const imEnd = tokenizer.encode('<|im_end|>', { addSpecial: false, parseSpecial: true });
    expect(imEnd).toHaveLength(1);
    expect(tokenizer.isEndOfGeneration(imEnd[0])).toBe(true);
  });

  it('gives templates no way to reach JavaScript objects', () => {
    const probes = [
      "{{ ''.constructor }}",
      '{{ messages.__proto__ }}',
      '{{ messages.constructor }}',
      "{{ messages[0]['__proto__'] }}",
      '{{ messages[0].content.__proto__ }}',
      '{{ globalThis }}{{ process }}{{ window }}{{ require }}',
      '{% set x = messages.__proto__ %}{{ x }}',
      '{{ (1).constructor }}{{ [].constructor }}',
    ];
    for (const probe of probes) {
      expect(renderChatTemplate(probe, { messages: conversation }), probe).toBe('');
    }
    // Calling through a prototype chain fails inside the interpreter instead of running code.
    expect(() =>
      renderChatTemplate("{{ ''.constructor.constructor('return process')() }}", { messages: conversation }),
    ).toThrow(InvalidRequestError);
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
  });

  it('reports a template that rejects the conversation, and one that does not parse', () => {
    const strict =
      "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}";
    expect(() => renderChatTemplate(strict, { messages: conversation })).toThrow(InvalidRequestError);
    expect(() => renderChatTemplate(strict, { messages: conversation })).toThrow(/must start with user/);
    expect(() => renderChatTemplate('{% for %}', { messages: conversation })).toThrow(UnsupportedModelError);
  });

  it('renders the real templates exactly as the library itself does, under the limits', () => {
    for (const name of ['llama3', 'qwen3'] as const) {
      const template = chatTemplateFromMetadata(metadataOf(name));
      const context = { messages: conversation, add_generation_prompt: true, bos_token: '<s>', eos_token: '</s>' };
      expect(renderChatTemplate(template, context)).toBe(new Template(template).render(context));
    }
    const dated = "{{ strftime_now('%d %b %Y') }}|{{ range(3, 0, -1) | join(',') }}|{{ None is none }}";
    expect(renderChatTemplate(dated, { messages: [] })).toMatch(/^\d\d [A-Z][a-z]{2} \d{4}\|3,2,1\|true$/);
  });
});

describe('chat templates under limits (a template is a program from a model file)', () => {
  const refuses = (fault: string, template: string, messages: ChatMessage[], pattern: RegExp) => {
    const started = performance.now();
    let refusal: unknown = null;
    try {
      renderChatTemplate(template, { messages });
    } catch (error) {
      refusal = error;
    }
    const seconds = (performance.now() - started) / 1000;
    // Each refusal comes within seconds, not after the process runs out of memory (or after 15 s a request).
    const inTime = seconds < 30;
    log.record({
      area: 'chat template',
      fault,
      expected: 'InvalidRequestError naming the limit, within 30 s',
      outcome: `${describeRefusal(refusal, pattern)}${inTime ? '' : `, after ${seconds.toFixed(0)} s`}`,
      ok: isRefusal(refusal, InvalidRequestError, pattern) && inTime,
    });
    expect(refusal).toBeInstanceOf(InvalidRequestError);
    expect((refusal as Error).message).toMatch(pattern);
    expect(seconds).toBeLessThan(30);
  };

  it('a range past its item limit, a string that doubles, a loop past its steps, output past its size', () => {
    refuses(
      'range(2147483647) in a for loop',
      '{% for i in range(2147483647) %}x{% endfor %}',
      conversation,
      /range\(\) of 2147483647 items/,
    );
    refuses(
      'range(1000000), an empty loop',
      '{% for i in range(1000000) %}{% endfor %}',
      conversation,
      /range\(\) of 1000000 items/,
    );
    refuses(
      'a string that doubles 40 times (8 characters to 8 Ti)',
      "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
      conversation,
      /a value of \d+ items/,
    );
    refuses(
      'loops nested 60000 × 60000 (3.6 billion steps), 4 messages',
      '{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}',
      conversation,
      new RegExp(`more than ${CHAT_TEMPLATE_LIMITS.stepsFloor + CHAT_TEMPLATE_LIMITS.stepsPerMessage * 4} steps`),
    );
    const page = [{ role: 'user', content: 'y'.repeat(4000) }];
    refuses(
      'a 4000-character message written 60000 times (240 M characters of output)',
      '{% for i in range(60000) %}{{ messages[0].content }}{% endfor %}',
      page,
      /output past \d+ characters/,
    );
  });

  it("checks a model's template when it loads: past the limits refused, a picky template left to the requests", () => {
    const probe = (template: string): unknown => {
      try {
        probeChatTemplate(template);
        return null;
      } catch (error) {
        return error;
      }
    };
    const hostile = probe('{% for i in range(2147483647) %}x{% endfor %}');
    log.record({
      area: 'model load',
      fault: "a model's template that loops over range(2147483647), checked on a short conversation at load",
      expected: 'UnsupportedModelError: the model is refused at load',
      outcome: describeError(hostile),
      ok: hostile instanceof UnsupportedModelError,
    });
    expect(hostile).toBeInstanceOf(UnsupportedModelError);
    const noSystem =
      "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
    for (const [fault, template] of [
      ['a template that raises on a system message (picky, not hostile), checked at load', noSystem],
      ["Qwen3's real template, checked at load", chatTemplateFromMetadata(metadataOf('qwen3'))],
    ]) {
      const error = probe(template);
      log.record({
        area: 'model load',
        fault,
        expected: 'accepted at load (a request it rejects fails then)',
        outcome: error === null ? 'accepted' : describeError(error),
        ok: error === null,
      });
      expect(error, fault).toBeNull();
    }
  });
});
