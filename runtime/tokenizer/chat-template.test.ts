import { Template } from '@huggingface/jinja';
import { describe, expect, it } from 'vitest';
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
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
  const refuses = (template: string, messages: ChatMessage[], pattern: RegExp) => {
    const started = performance.now();
    let refusal: unknown = null;
    try {
      renderChatTemplate(template, { messages });
    } catch (error) {
      refusal = error;
    }
    expect(refusal).toBeInstanceOf(InvalidRequestError);
    expect((refusal as Error).message).toMatch(pattern);
    // Each refusal comes within seconds, not after the process runs out of memory (or after 15 s a request).
    expect(performance.now() - started).toBeLessThan(30_000);
  };

  it('a range past its item limit, a string that doubles, a loop past its steps, output past its size', () => {
    refuses('{% for i in range(2147483647) %}x{% endfor %}', conversation, /range\(\) of 2147483647 items/);
    refuses('{% for i in range(1000000) %}{% endfor %}', conversation, /range\(\) of 1000000 items/);
    refuses(
      "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
      conversation,
      /a value of \d+ items/,
    );
    refuses(
      '{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}',
      conversation,
      new RegExp(`more than ${CHAT_TEMPLATE_LIMITS.stepsFloor + CHAT_TEMPLATE_LIMITS.stepsPerMessage * 4} steps`),
    );
    const page = [{ role: 'user', content: 'y'.repeat(4000) }];
    refuses('{% for i in range(60000) %}{{ messages[0].content }}{% endfor %}', page, /output past \d+ characters/);
  });

  it("checks a model's template when it loads: past the limits refused, a picky template left to the requests", () => {
    expect(() => probeChatTemplate('{% for i in range(2147483647) %}x{% endfor %}')).toThrow(UnsupportedModelError);
    const noSystem =
      "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
    expect(() => probeChatTemplate(noSystem)).not.toThrow();
    expect(() => probeChatTemplate(chatTemplateFromMetadata(metadataOf('qwen3')))).not.toThrow();
  });
});
