// outbox ui: the only script. Asks before a form that says data-confirm is sent; the
// pages work without it (the server checks every action itself).
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.getAttribute && form.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});
