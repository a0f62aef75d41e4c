/**
 * Model output rendered by <Markdown>: markup in the text must come out as escaped text, never as elements, links
 * only for http(s), no remote images; GFM tables; fenced code highlighted, with a copy button. Rendered to static
 * HTML with React's server renderer (no DOM needed).
 */
import { createElement } from 'react';
import { renderToStaticMarkup } from 'react-dom/server';
import { describe, expect, it } from 'vitest';
import { Markdown } from './Markdown.tsx';

const render = (text: string) => renderToStaticMarkup(createElement(Markdown, { text }));

describe('Markdown', () => {
  it('escapes HTML and script from the model', () => {
    const html = render('Hi <img src=x onerror="alert(1)"> <script>alert(2)</script>\n\n<iframe src="javascript:x">');
    expect(html).not.toMatch(/<img|<script|<iframe/);
    expect(html).toContain('&lt;img src=x onerror=&quot;alert(1)&quot;&gt;');
    expect(html).toContain('&lt;script&gt;alert(2)&lt;/script&gt;');
  });

  it('keeps http(s) links and drops javascript: and data: ones', () => {
    const html = render(
      '[ok](https://example.com/a) [bad](javascript:alert(1)) [data](data:text/html,<b>x</b>) ![pixel](https://t.example/p.png)',
    );
    expect(html).toContain('<a href="https://example.com/a" target="_blank" rel="noopener noreferrer nofollow">ok</a>');
    expect(html.match(/<a /g)).toHaveLength(1);
    expect(html).not.toContain('javascript');
    expect(html).not.toContain('data:');
    // The other links keep their text; an image shows its alt text and is never fetched.
    expect(html).toContain('<span>bad</span>');
    expect(html).toContain('<span>pixel</span>');
    expect(html).not.toMatch(/<img|t\.example/);
  });

  it('renders the markdown chat models write', () => {
    const html = render(
      '# Title\n\nSome **bold**, *italic* and `a<b>`.\n\n- one\n- two\n\n1. first\n\n```js\nlet x = 1 < 2;\n```\n\n> quoted',
    );
    expect(html).toContain('<h3>Title</h3>');
    expect(html).toContain('<strong>bold</strong>');
    expect(html).toContain('<em>italic</em>');
    expect(html).toContain('<code>a&lt;b&gt;</code>');
    expect(html).toMatch(/<ul>\s*<li>one<\/li>\s*<li>two<\/li>\s*<\/ul>/);
    expect(html).toMatch(/<ol>\s*<li>first<\/li>\s*<\/ol>/);
    // Highlighted: keywords and numbers in spans, the text still escaped; a copy button beside the language.
    expect(html).toContain(
      '<pre data-lang="js"><code class="hljs language-js"><span class="hljs-keyword">let</span> x = <span class="hljs-number">1</span> &lt; <span class="hljs-number">2</span>;',
    );
    expect(html).toContain('<span class="code-lang">js</span><button type="button" class="code-copy"');
    expect(html).toMatch(/<blockquote>\s*<p>quoted<\/p>\s*<\/blockquote>/);
  });

  it('leaves underscores inside words alone and shows an unclosed code fence while it streams', () => {
    expect(render('snake_case_name and a__b__c')).not.toContain('<strong>');
    expect(render('snake_case_name and a__b__c')).not.toContain('<em>');
    expect(render('```py\nprint(1)')).toMatch(
      /<pre data-lang="py"><code class="hljs language-py">.*print.*\(<span class="hljs-number">1<\/span>\)/,
    );
  });

  it('renders GFM tables, strikethrough and task lists', () => {
    const html = render('| a | b |\n| - | -: |\n| 1 | <i>2</i> |\n\n~~gone~~\n\n- [x] done');
    expect(html).toContain('<table><thead><tr><th>a</th><th style="text-align:right">b</th></tr></thead>');
    expect(html).toContain('<td style="text-align:right">&lt;i&gt;2&lt;/i&gt;</td>');
    expect(html).toContain('<del>gone</del>');
    expect(html).toContain('<input type="checkbox" disabled="" checked=""/> done');
  });
});
