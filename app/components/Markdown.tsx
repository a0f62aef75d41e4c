/**
 * Markdown to React elements, written here so model output can never become HTML: every piece of text ends up as a
 * React text node (escaped by React), there is no dangerouslySetInnerHTML, and links are kept only for http(s).
 * Covers what chat models write: paragraphs, headings, fenced code, inline code, bold, italic, links, lists, quotes.
 */
import { Fragment, type ReactNode } from 'react';

type Block =
  | { kind: 'code'; lang: string; text: string }
  | { kind: 'heading'; level: number; text: string }
  | { kind: 'list'; ordered: boolean; items: string[] }
  | { kind: 'quote'; text: string }
  | { kind: 'rule' }
  | { kind: 'paragraph'; text: string };

function parseBlocks(source: string): Block[] {
  const lines = source.replace(/\r\n?/g, '\n').split('\n');
  const blocks: Block[] = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i]!;
    const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)/);
    if (fence) {
      const body: string[] = [];
      i++;
      while (i < lines.length && !lines[i]!.trim().startsWith(fence[1]!)) body.push(lines[i++]!);
      i++; // closing fence (or end of a still-streaming block)
      blocks.push({ kind: 'code', lang: fence[2] ?? '', text: body.join('\n') });
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      blocks.push({ kind: 'heading', level: heading[1]!.length, text: heading[2]! });
      i++;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      blocks.push({ kind: 'rule' });
      i++;
      continue;
    }
    const bullet = /^\s*[-*+]\s+/;
    const numbered = /^\s*\d+[.)]\s+/;
    if (bullet.test(line) || numbered.test(line)) {
      const ordered = numbered.test(line);
      const marker = ordered ? numbered : bullet;
      const items: string[] = [];
      while (i < lines.length && marker.test(lines[i]!)) {
        let item = lines[i]!.replace(marker, '');
        i++;
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]!) && !marker.test(lines[i]!))
          item += ` ${lines[i++]!.trim()}`;
        items.push(item);
      }
      blocks.push({ kind: 'list', ordered, items });
      continue;
    }
    if (line.startsWith('>')) {
      const quoted: string[] = [];
      while (i < lines.length && lines[i]!.startsWith('>')) quoted.push(lines[i++]!.replace(/^>\s?/, ''));
      blocks.push({ kind: 'quote', text: quoted.join('\n') });
      continue;
    }
    const paragraph: string[] = [];
    while (
      i < lines.length &&
      lines[i]!.trim() &&
      !/^\s*(```|~~~)/.test(lines[i]!) &&
      !/^#{1,6}\s/.test(lines[i]!) &&
      !(paragraph.length > 0 && (bullet.test(lines[i]!) || numbered.test(lines[i]!)))
    ) {
      paragraph.push(lines[i++]!);
    }
    blocks.push({ kind: 'paragraph', text: paragraph.join('\n') });
  }
  return blocks;
}

function safeHref(url: string): string | null {
  try {
    const parsed = new URL(url);
    return parsed.protocol === 'http:' || parsed.protocol === 'https:' ? parsed.href : null;
  } catch {
    return null;
  }
}

/** Inline spans: `code`, **bold**, *italic* / _italic_, [text](url). Everything else is plain text. */
const INLINE =
  /(`+)([^`]+?)\1|\*\*(.+?)\*\*|(?<![\w])__(?!\s)(.+?)__(?![\w])|\*(?!\s)(.+?)\*|(?<![\w])_(?!\s)(.+?)_(?![\w])|\[([^\]]+)\]\(([^)\s]+)\)/s;

function renderInline(text: string, keyPrefix: string): ReactNode[] {
  const out: ReactNode[] = [];
  let rest = text;
  let n = 0;
  while (rest) {
    const match = INLINE.exec(rest);
    if (!match) {
      out.push(rest);
      break;
    }
    if (match.index > 0) out.push(rest.slice(0, match.index));
    const key = `${keyPrefix}-${n++}`;
    if (match[2] !== undefined) out.push(<code key={key}>{match[2]}</code>);
    else if (match[3] !== undefined || match[4] !== undefined)
      out.push(<strong key={key}>{renderInline(match[3] ?? match[4]!, key)}</strong>);
    else if (match[5] !== undefined || match[6] !== undefined)
      out.push(<em key={key}>{renderInline(match[5] ?? match[6]!, key)}</em>);
    else {
      const href = safeHref(match[8]!);
      out.push(
        href ? (
          <a key={key} href={href} target="_blank" rel="noopener noreferrer nofollow">
            {renderInline(match[7]!, key)}
          </a>
        ) : (
          <Fragment key={key}>{match[0]}</Fragment>
        ),
      );
    }
    rest = rest.slice(match.index + match[0].length);
  }
  return out;
}

function withLineBreaks(text: string, key: string): ReactNode[] {
  return text.split('\n').flatMap((line, index) => {
    const parts = renderInline(line, `${key}-${index}`);
    // biome-ignore lint/suspicious/noArrayIndexKey: lines of one immutable text; their position is their identity
    return index === 0 ? parts : [<br key={`${key}-br-${index}`} />, ...parts];
  });
}

export function Markdown({ text }: { text: string }) {
  const blocks = parseBlocks(text);
  return (
    <div className="markdown">
      {blocks.map((block, index) => {
        const key = `b${index}`;
        switch (block.kind) {
          case 'code':
            return (
              <pre key={key} data-lang={block.lang || undefined}>
                <code>{block.text}</code>
              </pre>
            );
          case 'heading': {
            const Tag = `h${Math.min(block.level + 2, 6)}` as 'h3';
            return <Tag key={key}>{renderInline(block.text, key)}</Tag>;
          }
          case 'list': {
            const items = block.items.map((item, j) => (
              // biome-ignore lint/suspicious/noArrayIndexKey: items of one immutable text; their position is their identity
              <li key={`${key}-${j}`}>{renderInline(item, `${key}-${j}`)}</li>
            ));
            return block.ordered ? <ol key={key}>{items}</ol> : <ul key={key}>{items}</ul>;
          }
          case 'quote':
            return <blockquote key={key}>{withLineBreaks(block.text, key)}</blockquote>;
          case 'rule':
            return <hr key={key} />;
          default:
            return <p key={key}>{withLineBreaks(block.text, key)}</p>;
        }
      })}
    </div>
  );
}
