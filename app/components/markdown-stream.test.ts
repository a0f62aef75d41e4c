/**
 * <Markdown> while a reply streams: each token re-parses only the open end of the reply (the work over a reply grows
 * with its length, not its square), the pieces render to the same HTML as one parse of the whole text, and a run of
 * punctuation that makes the parser quadratic is shown as plain text without being parsed. Work is counted in
 * characters handed to the parser (MarkdownStream.parsedChars), never timed.
 */
import { createElement } from 'react';
import { renderToStaticMarkup } from 'react-dom/server';
import { describe, expect, it } from 'vitest';
import { faultLog } from '../../test/regressions/fault-log.ts';
import { Markdown, MarkdownStream, PLAIN_RUN_MARKUP } from './Markdown.tsx';

const faults = faultLog('markdown');

const oneShot = (text: string) => renderToStaticMarkup(createElement(Markdown, { text }));
const streamed = (stream: MarkdownStream, text: string) =>
  renderToStaticMarkup(createElement('div', { className: 'markdown' }, ...stream.update(text)));

/** Streams text in chunks of `chunk` characters; checks every `checkEvery`-th prefix against a one-shot render. */
function streamReply(text: string, chunk: number, checkEvery = 0): MarkdownStream {
  const stream = new MarkdownStream();
  let step = 0;
  for (let end = chunk; end < text.length + chunk; end += chunk) {
    const prefix = text.slice(0, end);
    if (checkEvery && ++step % checkEvery === 0) {
      expect(streamed(stream, prefix), `after ${prefix.length} characters`).toBe(oneShot(prefix));
    } else {
      stream.update(prefix);
    }
  }
  expect(streamed(stream, text)).toBe(oneShot(text));
  return stream;
}

// The shapes a chat reply takes, with the cases where a later line changes an earlier one: setext headings, a list made
// loose by a blank line, a paragraph a list interrupts, a lazy blockquote line, blank lines inside a fence and inside
// an HTML comment, a table that becomes one only at its delimiter row.
const REPLY = [
  '# Plan',
  '',
  'Some **bold**, *italic*, `code` and a [link](https://example.com/a).',
  'Setext heading',
  '==============',
  '',
  '- one',
  '- two',
  '',
  '- three, loose now',
  '',
  'A paragraph',
  '- a list that interrupts it',
  '',
  '> quoted',
  'lazy line',
  '',
  '```ts',
  'const a = [1, 2];',
  '',
  'const b = a.map((x) => x * 2);',
  '```',
  '',
  '<!--',
  '',
  'inside a comment',
  '',
  '-->',
  '',
  '| name | value |',
  '| ---- | ----: |',
  '| x | 1 |',
  '',
  '1. first',
  '2. second',
  '',
  '***',
  '',
  'Closing words with ~~strike~~ and www.example.com.',
  '',
].join('\n');

describe('MarkdownStream', () => {
  it('renders every prefix of a streamed reply as one parse of that prefix would', () => {
    streamReply(REPLY, 3, 1);
  });

  it('parses a reply once when it is rendered whole', () => {
    const stream = new MarkdownStream();
    expect(streamed(stream, REPLY)).toBe(oneShot(REPLY));
    expect(stream.parses).toBe(1);
    expect(stream.parsedChars).toBe(REPLY.length);
  });

  it('does parsing work linear in the reply while it streams', () => {
    // A reply of 2 copies against one of 4: double the text, about double the characters parsed (the whole reply
    // re-parsed on every token would be four times).
    const work = (copies: number) => {
      const text = Array.from({ length: copies }, () => REPLY).join('\n');
      return streamReply(text, 4).parsedChars;
    };
    const [small, large] = [work(2), work(4)];
    faults.record({
      area: 'markdown',
      fault: `a reply streamed 4 characters a token, ${2 * REPLY.length} then ${4 * REPLY.length} characters long`,
      expected: 'characters parsed grow with the reply (1.8-2.2x for twice the text), not with its square',
      outcome: `${small} then ${large} characters parsed (${(large / small).toFixed(2)}x)`,
      ok: large / small > 1.8 && large / small < 2.2,
    });
    expect(large / small).toBeGreaterThan(1.8);
    expect(large / small).toBeLessThan(2.2);
    expect(small).toBeLessThan(REPLY.length * 2 * 20);
  });

  it('resolves a link reference or footnote defined after its use', () => {
    const text =
      'See [the docs] and a note[^1].\n\nMore text.\n\n[the docs]: https://example.com/docs\n\n[^1]: The note.\n';
    streamReply(text, 2, 1);
    expect(oneShot(text)).toContain('<a href="https://example.com/docs"');
    // Footnote links point inside the page, which safeUrl drops; the call and the section still render.
    expect(oneShot(text)).toContain('note<sup><span>1</span></sup>');
    expect(oneShot(text)).toContain('<section data-footnotes="true" class="footnotes">');
  });

  it('starts over when the text is not the previous text plus more', () => {
    const stream = new MarkdownStream();
    streamed(stream, '# One\n\nfirst paragraph\n\n');
    expect(streamed(stream, '# Two\n\nsecond')).toBe(oneShot('# Two\n\nsecond'));
  });
});

describe('Markdown with runs the parser is quadratic in', () => {
  const runs: Record<string, (n: number) => string> = {
    'closing brackets': (n) => ']'.repeat(n),
    'nested brackets': (n) => '['.repeat(n / 2) + ']'.repeat(n / 2),
    'brackets and parens': (n) => ']('.repeat(n / 2),
    'unmatched underscores': (n) => 'a_ '.repeat(n / 3),
    'unmatched stars': (n) => 'a* '.repeat(n / 3),
    tildes: (n) => '~a'.repeat(n / 2),
  };

  for (const [name, make] of Object.entries(runs)) {
    it(`shows a long run of ${name} as plain text without parsing it`, () => {
      for (const n of [4000, 16000]) {
        const run = make(n);
        const text = `# Before\n\n${run}\n\nAfter **that**.`;
        const stream = new MarkdownStream();
        const html = streamed(stream, text);
        const plain = html.includes(`<p style="white-space:pre-wrap">${run.trimEnd()}</p>`);
        faults.record({
          area: 'markdown',
          fault: `a run of ${n} characters of ${name} in a reply (micromark is quadratic in it)`,
          expected: 'the run shown as plain text, unparsed; the rest of the reply rendered as Markdown',
          outcome: `${plain ? 'plain text' : 'parsed'}; ${stream.parsedChars} of ${text.length} characters parsed`,
          ok: plain && html.includes('<strong>that</strong>') && stream.parsedChars <= text.length - run.length,
        });
        expect(html).toContain('<h3>Before</h3>');
        expect(html).toContain('<strong>that</strong>');
        expect(html).toContain(`<p style="white-space:pre-wrap">${run.trimEnd()}</p>`);
        // Only the heading and the closing line went through the parser.
        expect(stream.parsedChars).toBeLessThanOrEqual(text.length - run.length);
      }
    });
  }

  it('parses a streamed run only until it is over the limit', () => {
    // Doubling the run adds no parsing: past the limit, the open run is scanned for its end, not parsed.
    const work = (n: number) => streamReply(`## h\n\n${']'.repeat(n)}\n\ndone *here*`, 8).parsedChars;
    const [small, large] = [work(4000), work(8000)];
    expect(large).toBe(small);
    expect(small).toBeLessThan(PLAIN_RUN_MARKUP * PLAIN_RUN_MARKUP);
  });

  it('keeps Markdown for code and for paragraphs under the limit', () => {
    const code = '```ts\n' + 'a[i] = b[j] * c_d;\n'.repeat(300) + '```\n';
    expect(oneShot(code)).toContain('<pre data-lang="ts">');
    const links = Array.from({ length: 40 }, (_, i) => `[l${i}](https://e.x/${i}) **b**`).join(' ');
    expect(oneShot(links).match(/<a /g)).toHaveLength(40);
    const list = Array.from({ length: 400 }, (_, i) => `- [x](https://e.x/${i}) *i*`).join('\n');
    expect(oneShot(list).match(/<a /g)).toHaveLength(400);
  });
});
