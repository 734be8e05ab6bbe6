// The console's only script of its own: "select every row of this page" on the dead letters,
// and a fleet's database picker that goes to the database chosen without its Go button.
// Everything else works without it (htmx adds the live refresh of the overview and farm).
document.addEventListener("DOMContentLoaded", function () {
  var picker = document.getElementById("picker-select");
  if (picker) {
    picker.addEventListener("change", function () {
      picker.form.submit();
    });
  }
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll('#dlq-rows input[name="ids"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
});
