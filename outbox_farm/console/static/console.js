// The console's only script of its own: "select every row of this page" on the dead letters.
// Everything else works without it (htmx adds the live refresh of the overview and farm).
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll('#dlq-rows input[name="ids"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
});
