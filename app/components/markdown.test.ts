/**
 * Model output rendered by <Markdown>: markup in the text must come out as escaped text, never as elements, and
 * links only for http(s). Rendered to static HTML with React's server renderer (no DOM needed).
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
    const html = render('[ok](https://example.com/a) [bad](javascript:alert(1)) [data](data:text/html,<b>x</b>)');
    expect(html).toContain('<a href="https://example.com/a" target="_blank" rel="noopener noreferrer nofollow">ok</a>');
    expect(html).not.toContain('href="javascript');
    expect(html).not.toContain('href="data');
    expect(html).toContain('[bad](javascript:alert(1))');
  });

  it('renders the markdown chat models write', () => {
    const html = render(
      '# Title\n\nSome **bold**, *italic* and `a<b>`.\n\n- one\n- two\n\n1. first\n\n```js\nlet x = 1 < 2;\n```\n\n> quoted',
    );
    expect(html).toContain('<h3>Title</h3>');
    expect(html).toContain('<strong>bold</strong>');
    expect(html).toContain('<em>italic</em>');
    expect(html).toContain('<code>a&lt;b&gt;</code>');
    expect(html).toContain('<ul><li>one</li><li>two</li></ul>');
    expect(html).toContain('<ol><li>first</li></ol>');
    expect(html).toContain('<pre data-lang="js"><code>let x = 1 &lt; 2;</code></pre>');
    expect(html).toContain('<blockquote>quoted</blockquote>');
  });

  it('leaves underscores inside words alone and shows an unclosed code fence while it streams', () => {
    expect(render('snake_case_name and a__b__c')).not.toContain('<strong>');
    expect(render('snake_case_name and a__b__c')).not.toContain('<em>');
    expect(render('```py\nprint(1)')).toContain('<pre data-lang="py"><code>print(1)</code></pre>');
  });
});
