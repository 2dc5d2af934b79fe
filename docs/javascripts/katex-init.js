// Renders the math that pymdownx.arithmatex (generic mode) leaves in the page, with the KaTeX
// copy under docs/vendor/katex; runs again after every instant-navigation page load.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});
